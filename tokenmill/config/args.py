"""`EngineArgs`: exactly what a user passes, with vLLM's names.

CLI flags and `LLM(...)` keyword arguments share its field names. Resolving
it (`EngineArgs.create_engine_config`) reads the model's config, picks the
device and dtype, and fills per-device defaults (`tokenmill.config.resolve`,
imported lazily: it imports downward into the loader, platforms and
executor). Errors are `ValueError`s with a sentence saying what to change.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill.config.configs import VLLM_ATTENTION_BACKENDS, parse_size

if TYPE_CHECKING:
    from tokenmill.config.configs import EngineConfig


@dataclass
class EngineArgs:
    """Every engine argument, with vLLM's names; CLI flags are these with dashes."""

    model: str | None = None
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    revision: str | None = None
    trust_remote_code: bool = False
    download_dir: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    quantization: str | None = None  # awq | gptq | compressed-tensors | mxfp4 (+ vLLM's aliases); None: the checkpoint's
    seed: int = 0
    max_model_len: int | None = None
    served_model_name: str | list[str] | None = None  # several names: all accepted, the first reported
    tokenizer_mode: str = "auto"
    generation_config: str = "auto"
    max_logprobs: int = 20
    chat_template: str | None = None
    # cache
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | fp8 | fp8_e4m3 | fp8_e5m2
    kv_cache_memory_bytes: int | str | None = None
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float | None = None  # None: 0.9 (DEFAULT_GPU_MEMORY_UTILIZATION); GPUs only
    enable_prefix_caching: bool = True
    disable_hybrid_kv_cache_manager: bool = False  # one KV group even for half-sliding-window models
    # scheduler
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # > 0: a prefill takes at most this many tokens per step
    # > 0: prefill tokens of a step with running decodes (0: off); None: 2048 for the server on >= 70 GiB GPUs, else off
    max_prefill_tokens_with_decodes: int | None = None
    scheduling_policy: str = "fcfs"
    async_scheduling: bool | None = None  # None: on for one CUDA device, off elsewhere
    # device
    device: str = "auto"
    attention_backend: str | None = None
    enforce_eager: bool = False
    max_seq_len_to_capture: int | None = None  # None: max_model_len (graphs at every length, as vLLM V1)
    # parallel
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    disable_custom_all_reduce: bool = False  # accepted from LLM(...); nothing to disable here
    # logging
    disable_log_stats: bool = False

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add the engine flags (vLLM's spellings) to `parser`.

        Flags that take one of a few values have no argparse `choices`: an
        unknown value (e.g. a vLLM-only --load-format) fails at resolution
        with a sentence instead of a usage dump.
        """
        d = EngineArgs()
        g = parser.add_argument_group("model")
        g.add_argument("--tokenizer", default=None, help="Tokenizer folder or repo id (default: the model's).")
        g.add_argument("--skip-tokenizer-init", action="store_true", help="Do not load a tokenizer; token-id prompts only.")
        g.add_argument("--revision", default=None, help="Hub revision of the model.")
        g.add_argument("--trust-remote-code", action="store_true",
                       help="Passed to transformers when reading the model's config and tokenizer.")
        g.add_argument("--download-dir", default=None, help="Where hub downloads go (default: the hub cache).")
        g.add_argument("--load-format", default=d.load_format,
                       help="auto, safetensors, gguf, pt, or dummy (random weights from config.json).")
        g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "float16", "bfloat16", "half", "float", "fp16", "bf16", "fp32"],
                       help="auto: float32 on CPU (keeps small models' answers right), bfloat16 on GPUs with cc >= 8.0, "
                            "float16 below; AWQ and GPTQ checkpoints: float16 on GPUs (as vLLM).")
        g.add_argument("--quantization", "-q", default=None,
                       help="awq, gptq, compressed-tensors (vLLM's awq_marlin / gptq_marlin are aliases), fp8 or "
                            "mxfp4 (gpt-oss): must match the checkpoint's quantization_config (default: the "
                            "checkpoint's method); fp8 on a 16-bit checkpoint quantizes its weights at load.")
        g.add_argument("--seed", type=int, default=d.seed)
        g.add_argument("--max-model-len", type=_int_or_size, default=None, help="Context length (default: the model's limit).")
        g.add_argument("--served-model-name", nargs="+", default=None,
                       help="Name(s) clients use; requests may use any, responses report the first "
                            "(default: the model argument).")
        g.add_argument("--tokenizer-mode", default=d.tokenizer_mode,
                       help="auto/hf: the fast tokenizer; slow: the Python one (mistral and custom are not built).")
        g.add_argument("--generation-config", default=d.generation_config,
                       help="auto: apply the model's generation_config.json defaults; vllm: ignore them.")
        g.add_argument("--max-logprobs", type=int, default=d.max_logprobs, help="Largest logprobs/top_logprobs a request may ask for.")
        g.add_argument("--chat-template", default=None, help="Chat template file or inline Jinja text (default: the tokenizer's).")
        g = parser.add_argument_group("cache")
        g.add_argument("--block-size", type=int, default=d.block_size, help="Tokens per KV-cache block.")
        g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype,
                       help="auto (the model dtype), fp8 / fp8_e4m3 or fp8_e5m2: the KV cache in 8 bits (about 2x "
                            "the tokens of a 16-bit cache), scaled per layer by the checkpoint's k_scale / v_scale "
                            "(1.0 without them); docs/quantization.md.")
        g.add_argument("--kv-cache-memory-bytes", type=_byte_size, default=None,
                       help="KV cache size, e.g. 4G (CPU default: 0.4 x the memory available after loading the "
                            "weights, cgroup limit included, at most 16 GiB; on GPU overrides "
                            "--gpu-memory-utilization).")
        g.add_argument("--num-gpu-blocks-override", type=int, default=None, help="Fix the number of KV blocks (any device; for tests).")
        g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                       help="Fraction of GPU memory tokenmill may use (weights + activations + KV cache; default "
                            "0.9); GPUs only: on CPU the KV cache is sized by --kv-cache-memory-bytes or its "
                            "default, and a given value is logged as unused.")
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="Reuse KV blocks of repeated prompt prefixes (default on).")
        g.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                       help="Keep full-length KV on sliding-window layers too (models with half full, half "
                            "sliding-window layers, e.g. gpt-oss, otherwise free blocks that slid out of the window "
                            "and turn prefix caching off).")
        g = parser.add_argument_group("scheduler")
        g.add_argument("--max-num-seqs", type=int, default=None,
                       help="Max requests in one step. Default as vLLM: CPU 256 offline / 128 server; GPU 1024 on >= 70 GiB cards, else 256.")
        g.add_argument("--max-num-batched-tokens", type=_int_or_size, default=None,
                       help="Token budget of one step. Default as vLLM: CPU 4096 offline / 2048 server; GPU 16384 offline / 8192 server on >= 70 GiB cards, else 8192 / 2048.")
        g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                       help="Split long prompts over steps so decodes keep running (default on).")
        g.add_argument("--long-prefill-token-threshold", type=int, default=d.long_prefill_token_threshold,
                       help="With chunked prefill: a prompt takes at most this many tokens per step (0: off, the "
                            "default), so long prompts leave room in each step for others and for running decodes.")
        g.add_argument("--max-prefill-tokens-with-decodes", type=_int_or_size, default=None,
                       help="With chunked prefill: a step that carries running decodes takes at most this many "
                            "prefill tokens (0: off), so a long prompt does not stall every decode for a full-budget "
                            "step (tokenmill's own; Sarathi-Serve's stall-free batching); steps without decodes keep "
                            "--max-num-batched-tokens. Default: 2048 for the server on GPUs with >= 70 GiB, else 0.")
        g.add_argument("--scheduling-policy", default=d.scheduling_policy, choices=["fcfs", "priority"],
                       help="fcfs: arrival order; priority: smaller `priority` first, then arrival.")
        g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="Schedule and prepare step N+1 while step N runs on the device (default: on for one GPU, "
                            "off on CPU and for several ranks; requests with penalties, min_tokens or structured "
                            "output run synchronous steps).")
        g = parser.add_argument_group("device")
        g.add_argument("--device", default=d.device, help="auto, cpu or cuda.")
        g.add_argument("--attention-backend", default=None, type=str.upper,
                       help="TORCH_SDPA or TRITON_ATTN (default: the platform's); vLLM's names "
                            f"({', '.join(VLLM_ATTENTION_BACKENDS)}) map to this device's best one.")
        g.add_argument("--enforce-eager", action="store_true", help="Disable CUDA graphs.")
        g.add_argument("--max-seq-len-to-capture", type=int, default=d.max_seq_len_to_capture,
                       help="Steps (decode or mixed) whose longest sequence is above this run eagerly, not in a "
                            "CUDA graph (default: max_model_len, so every length replays graphs).")
        g = parser.add_argument_group("parallel")
        g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
        g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
        g.add_argument("--distributed-executor-backend", default=None, help="mp, ray or uni.")
        g.add_argument("--disable-log-stats", action="store_true",
                       help="No periodic engine stats line in the server log.")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def create_engine_config(self, usage: str = "llm") -> EngineConfig:
        """Resolve the arguments into configs.

        Args:
            usage: "llm" (offline `LLM`) or "server": picks vLLM's per-usage
                scheduler defaults.

        Raises:
            ValueError: an argument is invalid for this model or device.
        """
        from tokenmill.config.resolve import resolve_engine_config

        return resolve_engine_config(self, usage)


def _int_or_size(value: str) -> int:
    """A token count, also as `32k` / `128K` (vLLM's human-readable ints); argparse prints the sentence.

    A plain number must be whole (`1.5` is refused, not truncated; `1.5k` is 1500) and not negative.
    """
    text = value.strip()
    if text.startswith("-"):
        raise argparse.ArgumentTypeError(f"{value!r} is negative; a token count is 0 or more, e.g. 4096, 32k or 128K.")
    if text.replace(".", "", 1).isdigit() and "." in text:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number of tokens; use e.g. 4096, 32k or 128K.")
    try:
        return parse_size(value)
    except ValueError:
        message = f"cannot read {value!r} as a token count; use e.g. 4096, 32k or 128K."
        raise argparse.ArgumentTypeError(message) from None


def _byte_size(value: str) -> int:
    """A byte count (`parse_size`); argparse prints its sentence (it drops a plain ValueError's message)."""
    try:
        return parse_size(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
