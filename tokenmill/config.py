"""Engine configuration: the user's arguments (`EngineArgs`) and the resolved configs.

`EngineArgs` holds exactly what a user passes (CLI flags and `LLM(...)`
keyword arguments share its field names, which are vLLM's). Resolving it
(`EngineArgs.create_engine_config`) reads the model's config, picks the
device and dtype, and fills per-device defaults. Errors are `ValueError`s
with a sentence saying what to change.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?[bB]?)?\s*$")


def parse_size(value: str | int) -> int:
    """Parse a byte count such as `4G`, `512M`, `1.5g` or `1073741824`.

    As vLLM's `human_readable_int`: an upper-case suffix is binary (K = 1024),
    a lower-case one decimal (k = 1000); `GiB`/`GB` spellings are accepted.

    Raises:
        ValueError: if the text is not a size.
    """
    if isinstance(value, int):
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(f"Cannot read {value!r} as a size in bytes; use e.g. 4G, 512M or 1073741824.")
    num, unit, tail = float(m.group(1)), m.group(2), (m.group(3) or "")
    if not unit:
        return int(num)
    power = "kmgt".index(unit.lower()) + 1
    binary = unit.isupper() or tail.lower().startswith("i")
    return int(num * ((1024 if binary else 1000) ** power))


@dataclass(slots=True)
class ModelConfig:
    """The model, resolved. `hf_config` is a transformers `PretrainedConfig`."""

    model: str  # what the user passed (path, file or repo id)
    model_path: str  # local folder or .gguf file actually loaded
    gguf_file: str | None  # set when weights come from a GGUF file
    tokenizer: str | None  # local path of the tokenizer (None with skip_tokenizer_init)
    skip_tokenizer_init: bool
    load_format: str  # auto | safetensors | gguf | dummy | pt
    dtype: str  # resolved: float32 | float16 | bfloat16
    seed: int
    max_model_len: int
    architecture: str
    hf_config: Any
    generation_config: dict[str, Any] = field(default_factory=dict)
    served_model_name: str = ""
    max_logprobs: int = 20
    trust_remote_code: bool = False
    revision: str | None = None
    chat_template: str | None = None


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # explicit KV size (CPU default: from free memory, platforms/memory.py)
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    num_gpu_blocks: int = 0  # filled after memory profiling


def kv_memory_hint(cache_config: CacheConfig, device: str) -> str:
    """The flag that would give the KV cache more memory, with its current value (for error messages).

    device: "cpu" or "cuda". Example: "raise --gpu-memory-utilization (now 0.9), or lower ...".
    """
    cc = cache_config
    if cc.num_gpu_blocks_override is not None:
        return f"raise --num-gpu-blocks-override (now {cc.num_gpu_blocks_override})"
    if cc.kv_cache_memory_bytes is not None or device != "cuda":
        if cc.kv_cache_memory_bytes is None:
            return "set --kv-cache-memory-bytes (the default is a share of the free memory)"
        return f"raise --kv-cache-memory-bytes (now {cc.kv_cache_memory_bytes / 2**30:.2f} GiB)"
    return (f"raise --gpu-memory-utilization (now {cc.gpu_memory_utilization}), or lower "
            "--max-num-batched-tokens or --max-num-seqs (less activation memory)")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # fcfs | priority
    # Schedule step N+1 while step N runs (its sampled ids are read on the device).
    async_scheduling: bool = False


@dataclass(slots=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # mp | ray | uni
    disable_custom_all_reduce: bool = False

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(slots=True)
class DeviceConfig:
    device: str = "cpu"  # cpu | cuda
    attention_backend: str | None = None  # TORCH_SDPA | TRITON_ATTN | None (auto)
    enforce_eager: bool = False
    # Simulate a compute-capability-7.0 GPU (fp16 only, no flash SDPA, sm_70
    # Triton paths) on any CUDA device: env TOKENMILL_FORCE_CC70=1.
    force_cc70: bool = False


@dataclass(slots=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig


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
    seed: int = 0
    max_model_len: int | None = None
    served_model_name: str | None = None
    generation_config: str = "auto"
    max_logprobs: int = 20
    chat_template: str | None = None
    # cache
    block_size: int = 16
    kv_cache_memory_bytes: int | str | None = None
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # scheduler
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    async_scheduling: bool | None = None  # None: on for one CUDA device, off elsewhere
    # device
    device: str = "auto"
    attention_backend: str | None = None
    enforce_eager: bool = False
    # parallel
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    disable_custom_all_reduce: bool = False
    # logging
    disable_log_stats: bool = False

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add the engine flags (vLLM's spellings) to `parser`."""
        d = EngineArgs()
        g = parser.add_argument_group("model")
        g.add_argument("--tokenizer", default=None, help="Tokenizer folder or repo id (default: the model's).")
        g.add_argument("--skip-tokenizer-init", action="store_true", help="Do not load a tokenizer; token-id prompts only.")
        g.add_argument("--revision", default=None, help="Hub revision of the model.")
        g.add_argument("--trust-remote-code", action="store_true", help="Accepted for vLLM compatibility; no remote code is run.")
        g.add_argument("--download-dir", default=None, help="Where hub downloads go (default: the hub cache).")
        g.add_argument("--load-format", default=d.load_format, choices=["auto", "safetensors", "gguf", "dummy", "pt"],
                       help="Weight format; dummy = random weights from config.json.")
        g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "float16", "bfloat16", "half", "float", "fp16", "bf16", "fp32"],
                       help="auto: float32 on CPU (keeps small models' answers right), bfloat16 on GPUs with cc >= 8.0, float16 below.")
        g.add_argument("--seed", type=int, default=d.seed)
        g.add_argument("--max-model-len", type=_int_or_size, default=None, help="Context length (default: the model's limit).")
        g.add_argument("--served-model-name", default=None, help="Name clients use (default: the model argument).")
        g.add_argument("--generation-config", default=d.generation_config,
                       help="auto: apply the model's generation_config.json defaults; vllm: ignore them.")
        g.add_argument("--max-logprobs", type=int, default=d.max_logprobs, help="Largest logprobs/top_logprobs a request may ask for.")
        g.add_argument("--chat-template", default=None, help="Chat template file or inline Jinja text (default: the tokenizer's).")
        g = parser.add_argument_group("cache")
        g.add_argument("--block-size", type=int, default=d.block_size, help="Tokens per KV-cache block.")
        g.add_argument("--kv-cache-memory-bytes", type=parse_size, default=None,
                       help="KV cache size, e.g. 4G (CPU default: 0.4 x the memory available after loading the "
                            "weights, cgroup limit included, at most 16 GiB; on GPU overrides "
                            "--gpu-memory-utilization).")
        g.add_argument("--num-gpu-blocks-override", type=int, default=None, help="Fix the number of KV blocks (any device; for tests).")
        g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                       help="Fraction of GPU memory tokenmill may use (weights + activations + KV cache).")
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="Reuse KV blocks of repeated prompt prefixes (default on).")
        g = parser.add_argument_group("scheduler")
        g.add_argument("--max-num-seqs", type=int, default=None,
                       help="Max requests in one step. Default as vLLM: CPU 256 offline / 128 server; GPU 1024 on >= 70 GiB cards, else 256.")
        g.add_argument("--max-num-batched-tokens", type=_int_or_size, default=None,
                       help="Token budget of one step. Default as vLLM: CPU 4096 offline / 2048 server; GPU 16384 offline / 8192 server on >= 70 GiB cards, else 8192 / 2048.")
        g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                       help="Split long prompts over steps so decodes keep running (default on).")
        g.add_argument("--scheduling-policy", default=d.scheduling_policy, choices=["fcfs", "priority"],
                       help="fcfs: arrival order; priority: smaller `priority` first, then arrival.")
        g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="Schedule and prepare step N+1 while step N runs on the device (default: on for one GPU, "
                            "off on CPU and for several ranks; requests with penalties, min_tokens or structured "
                            "output run synchronous steps).")
        g = parser.add_argument_group("device")
        g.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
        g.add_argument("--attention-backend", default=None, choices=["TORCH_SDPA", "TRITON_ATTN"],
                       help="Override the platform's attention backend.")
        g.add_argument("--enforce-eager", action="store_true", help="Disable CUDA graphs.")
        g = parser.add_argument_group("parallel")
        g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
        g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
        g.add_argument("--distributed-executor-backend", default=None, choices=["mp", "ray", "uni"])
        g.add_argument("--disable-custom-all-reduce", action="store_true", help="Accepted for vLLM compatibility.")
        g.add_argument("--disable-log-stats", action="store_true")
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
        from tokenmill.config_resolve import resolve_engine_config

        return resolve_engine_config(self, usage)


def _int_or_size(value: str) -> int:
    return parse_size(value)
