"""Every `vllm serve` flag tokenmill knows, with what tokenmill does with it (docs/flags.md is generated from here).

Each flag is one of:

    implemented   it works as in vLLM (its parser entry lives with the code that uses it)
    ignored       it means nothing here; accepted, and one log line says so and why
    not-built     it names something tokenmill does not have yet; start-up fails with a sentence

The ignored and not-built flags are defined here (`add_compat_cli_args`), so a
vLLM launch script parses; `check_compat_flags` then logs or refuses them
before anything loads. A not-built flag given its "off" value (`--cpu-offload-gb 0`,
`--data-parallel-size 1`, `--task generate`) asks for nothing and passes silently.

`python -m tokenmill.config.vllm_flags` prints the markdown table of docs/flags.md.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

logger = logging.getLogger(__name__)

Status = Literal["implemented", "ignored", "not-built"]


@dataclass(frozen=True, slots=True)
class FlagInfo:
    """One row of the flag table."""

    flag: str  # the long spelling, e.g. "--swap-space"
    status: Status
    note: str  # implemented: what it does; ignored: why; not-built: the sentence start-up fails with
    example: tuple[str, ...]  # a command-line fragment that sets it (the table test parses it)
    # Only for flags defined here (ignored / not-built): "switch" (no value), "value", or "values" (nargs="+").
    kind: str | None = None
    # not-built flags: given values that ask for nothing (compared as strings) and pass silently.
    inert: tuple[str, ...] = field(default_factory=tuple)

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


def _i(flag: str, note: str, example: tuple[str, ...], **kw: Any) -> FlagInfo:
    return FlagInfo(flag, "implemented", note, example, **kw)


def _ign(flag: str, note: str, example: tuple[str, ...], kind: str = "value") -> FlagInfo:
    return FlagInfo(flag, "ignored", note, example, kind=kind)


def _nb(flag: str, note: str, example: tuple[str, ...], kind: str = "value", inert: tuple[str, ...] = ()) -> FlagInfo:
    return FlagInfo(flag, "not-built", note, example, kind=kind, inert=inert)


FLAGS: tuple[FlagInfo, ...] = (
    # --- model ---
    _i("--model", "The model: a local folder, a .gguf file, a Hugging Face repo id or modelscope:<id> "
       "(same as the positional MODEL).", ("--model", "{model}")),
    _i("--tokenizer", "Tokenizer folder or repo id.", ("--tokenizer", "{tokenizer}")),
    _i("--tokenizer-mode", "auto and hf: the fast Hugging Face tokenizer; slow is accepted and logged (the "
       "detokenizer needs the fast one, which gives the same tokens); mistral and custom are refused.",
       ("--tokenizer-mode", "mistral")),
    _i("--skip-tokenizer-init", "No tokenizer; token-id prompts only.", ("--skip-tokenizer-init",)),
    _i("--revision", "Hub revision of the model.", ("--revision", "main")),
    _i("--trust-remote-code", "Passed to transformers when reading the config and tokenizer.",
       ("--trust-remote-code",)),
    _i("--download-dir", "Where hub downloads go.", ("--download-dir", "/tmp/tm-downloads")),
    _i("--load-format", "auto, safetensors, gguf, pt or dummy (random weights).", ("--load-format", "dummy")),
    _i("--dtype", "auto, float32, float16/half, bfloat16; auto is float32 on CPU, bfloat16 on cc >= 8.0 GPUs, "
       "float16 below; AWQ and GPTQ checkpoints get float16 on every GPU (as vLLM).", ("--dtype", "half")),
    _i("--quantization", "awq, gptq, compressed-tensors, fp8 (-q; awq_marlin / gptq_marlin are aliases): int4/int8 "
       "and FP8 checkpoints; fp8 on a 16-bit checkpoint quantizes it at load (per-channel weights, dynamic "
       "per-token activations); mxfp4 confirms a gpt-oss MXFP4 checkpoint; detected from the checkpoint without "
       "the flag; a method that disagrees with the "
       "checkpoint fails at start-up (docs/quantization.md).", ("--quantization", "awq")),
    _i("--seed", "Seed of the sampler's random generator.", ("--seed", "7")),
    _i("--max-model-len", "Context length (default: the model's).", ("--max-model-len", "512")),
    _i("--served-model-name", "One or more names; requests may use any, the first is reported.",
       ("--served-model-name", "a", "b")),
    _i("--generation-config", "auto: the model's generation_config.json defaults; vllm: none; or a folder.",
       ("--generation-config", "vllm")),
    _i("--max-logprobs", "Largest logprobs / top_logprobs a request may ask for.", ("--max-logprobs", "5")),
    _i("--chat-template", "A template file or inline Jinja text; a missing file fails at start-up.",
       ("--chat-template", "{{ messages[0]['content'] }}")),
    # --- cache ---
    _i("--block-size", "Tokens per KV-cache block.", ("--block-size", "32")),
    _i("--kv-cache-dtype", "auto (the model dtype), fp8 / fp8_e4m3 or fp8_e5m2: K and V stored in 8 bits (2x "
       "the tokens of a 16-bit cache, 4x float32's), scaled per layer by the checkpoint's k_scale / v_scale "
       "(1.0 without them); every device and backend (docs/quantization.md).", ("--kv-cache-dtype", "fp8")),
    _i("--kv-cache-memory-bytes", "KV cache size (CPU default 0.4 x available memory, at most 16 GiB; on GPU "
       "overrides --gpu-memory-utilization).", ("--kv-cache-memory-bytes", "1G")),
    _i("--num-gpu-blocks-override", "Fix the number of KV blocks.", ("--num-gpu-blocks-override", "64")),
    _i("--gpu-memory-utilization", "Fraction of GPU memory tokenmill may use (GPUs only: on CPU the KV cache "
       "is sized by --kv-cache-memory-bytes or its default, and a given value is logged as unused).",
       ("--gpu-memory-utilization", "0.5")),
    _i("--enable-prefix-caching", "Reuse KV blocks of repeated prefixes (default on; --no-enable-prefix-caching).",
       ("--no-enable-prefix-caching",)),
    _i("--disable-hybrid-kv-cache-manager", "One KV group even for half-sliding-window models (gpt-oss): full-length "
       "KV on every layer, prefix caching kept.", ("--disable-hybrid-kv-cache-manager",)),
    # --- scheduler ---
    _i("--max-num-seqs", "Most requests in one step.", ("--max-num-seqs", "7")),
    _i("--max-num-batched-tokens", "Token budget of one step.", ("--max-num-batched-tokens", "1000")),
    _i("--enable-chunked-prefill", "Split long prompts over steps (default on; --no-enable-chunked-prefill).",
       ("--no-enable-chunked-prefill",)),
    _i("--long-prefill-token-threshold", "With chunked prefill, a prompt takes at most this many tokens per step "
       "(0: off); keeps room in each step for running decodes.", ("--long-prefill-token-threshold", "512")),
    _i("--max-prefill-tokens-with-decodes", "With chunked prefill, a step that carries running decodes takes at "
       "most this many prefill tokens (0: off), so long prompts do not stall decodes; steps without decodes keep "
       "--max-num-batched-tokens (tokenmill's own; default 2048 for the server on GPUs with >= 70 GiB, else 0).",
       ("--max-prefill-tokens-with-decodes", "512")),
    _i("--scheduling-policy", "fcfs or priority.", ("--scheduling-policy", "priority")),
    _i("--async-scheduling", "Prepare step N+1 while step N runs (default: on for one GPU).", ("--async-scheduling",)),
    # --- device ---
    _i("--device", "auto, cpu or cuda.", ("--device", "cuda")),
    _i("--attention-backend", "TORCH_SDPA or TRITON_ATTN; vLLM's FLASH_ATTN, FLASHINFER, XFORMERS, TRITON_ATTN_VLLM_V1 "
       "and TORCH_SDPA_VLLM_V1 map to this device's best backend, with a log line.",
       ("--attention-backend", "FLASH_ATTN")),
    _i("--enforce-eager", "No CUDA graphs.", ("--enforce-eager",)),
    _i("--max-seq-len-to-capture", "Steps (decode or mixed) whose longest sequence is above this run eagerly "
       "instead of in a CUDA graph (default: max_model_len, so decode steps at any context length replay graphs, "
       "as in vLLM V1, which dropped the flag; vLLM V0's default was 8192. On an H200 a 126k-token Llama-3.1-8B "
       "decode step took 30.1 ms eagerly for 9.8 ms of GPU work).", ("--max-seq-len-to-capture", "1024")),
    # --- parallel ---
    _i("--tensor-parallel-size", "Tensor-parallel ranks (-tp).", ("--tensor-parallel-size", "3")),
    _i("--pipeline-parallel-size", "Pipeline stages (-pp).", ("--pipeline-parallel-size", "2")),
    _i("--distributed-executor-backend", "mp, ray or uni.", ("--distributed-executor-backend", "uni")),
    # --- server ---
    _i("--host", "Address to listen on (default env TOKENMILL_HOST, else 127.0.0.1).", ("--host", "0.0.0.0")),
    _i("--port", "TCP port (1-65535; default 8000).", ("--port", "8123")),
    _i("--uvicorn-log-level", "uvicorn's log level.", ("--uvicorn-log-level", "warning")),
    _i("--disable-uvicorn-access-log", "No log line per HTTP request.", ("--disable-uvicorn-access-log",)),
    _i("--root-path", "ASGI root_path, for a server behind a path-prefixing proxy.", ("--root-path", "/llm")),
    _i("--allowed-origins", "CORS allowed origins (JSON list). Without any CORS flag no CORS headers are sent "
       "(vLLM allows every origin by default; pass '[\"*\"]' for that).", ("--allowed-origins", '["*"]')),
    _i("--allowed-methods", "CORS allowed methods (JSON list; default all).", ("--allowed-methods", '["GET"]')),
    _i("--allowed-headers", "CORS allowed headers (JSON list; default all).", ("--allowed-headers", '["X-A"]')),
    _i("--allow-credentials", "CORS: allow credentials.", ("--allow-credentials",)),
    _i("--ssl-keyfile", "TLS private key file (with --ssl-certfile).", ("--ssl-keyfile", "key.pem")),
    _i("--ssl-certfile", "TLS certificate file.", ("--ssl-certfile", "cert.pem")),
    _i("--ssl-ca-certs", "CA certificates to verify clients.", ("--ssl-ca-certs", "ca.pem")),
    _i("--ssl-cert-reqs", "Whether client certificates are required (ssl.CERT_* number).", ("--ssl-cert-reqs", "2")),
    _i("--middleware", "Import path of an ASGI middleware class or an HTTP middleware function (repeatable).",
       ("--middleware", "starlette.middleware.gzip.GZipMiddleware")),
    _i("--disable-fastapi-docs", "No /docs, /redoc, /openapi.json.", ("--disable-fastapi-docs",)),
    _i("--api-key", "Bearer key(s) required on the API routes (default env TOKENMILL_API_KEY, else VLLM_API_KEY).",
       ("--api-key", "k")),
    _i("--max-request-body-bytes", "Larger bodies get 413 (tokenmill's own).", ("--max-request-body-bytes", "1000")),
    _i("--request-header-timeout", "Seconds a connection may take to send a request's headers; then 408 and "
       "close (tokenmill's own; default 10).", ("--request-header-timeout", "2.5")),
    _i("--request-body-timeout", "Seconds a request may take to send its body; then 408 (tokenmill's own; "
       "default 30).", ("--request-body-timeout", "5")),
    _i("--limit-concurrency", "Most open connections / requests in flight; past it a JSON 503 (default 1024).",
       ("--limit-concurrency", "8")),
    _i("--trust-request-chat-template", "Lets requests carry chat_template text (never a path); off: such "
       "requests get 400.", ("--trust-request-chat-template",)),
    _i("--sanitize-control-tokens", "Renders user-supplied text with special tokens escaped (tokenmill's own; "
       "off by default, as vLLM).", ("--sanitize-control-tokens",)),
    _i("--metrics-vllm-names", "Also export /metrics under the vllm: prefix (tokenmill's own).",
       ("--metrics-vllm-names",)),
    _i("--shutdown-timeout", "Seconds in-flight requests get on SIGTERM (tokenmill's own).",
       ("--shutdown-timeout", "3")),
    _i("--enable-auto-tool-choice", "tool_choice auto (needs --tool-call-parser).",
       ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")),
    _i("--tool-call-parser", "hermes, qwen3_coder, llama3_json, mistral; used with --enable-auto-tool-choice "
       "(a warning without it).", ("--tool-call-parser", "hermes")),
    _i("--reasoning-parser", "qwen3 or deepseek_r1: message.reasoning_content.", ("--reasoning-parser", "qwen3")),
    _i("--enable-log-requests", "Log each request (id, prompt, sampling parameters) when it arrives.",
       ("--enable-log-requests",)),
    _i("--disable-log-requests", "Requests are not logged (the default; kept for older vLLM scripts).",
       ("--enable-log-requests", "--disable-log-requests")),
    _i("--max-log-len", "Longest prompt prefix (characters and token ids) a request log line shows.",
       ("--enable-log-requests", "--max-log-len", "10")),
    _i("--disable-log-stats", "No periodic engine stats line (every 10 s while requests run).",
       ("--disable-log-stats",)),
    # --- ignored: meaningless here ---
    _ign("--swap-space", "tokenmill has no CPU swap space; a preempted request is recomputed.",
         ("--swap-space", "4")),
    _ign("--disable-custom-all-reduce", "tokenmill has no custom all-reduce kernel; tensor parallelism always uses "
         "torch.distributed (NCCL / gloo).", ("--disable-custom-all-reduce",), kind="switch"),
    _ign("--disable-frontend-multiprocessing", "the HTTP front end and the engine core always run in separate "
         "processes.", ("--disable-frontend-multiprocessing",), kind="switch"),
    _ign("--use-v2-block-manager", "the paged KV-cache manager is the only one (as in vLLM >= 0.6).",
         ("--use-v2-block-manager",), kind="switch"),
    _ign("--num-scheduler-steps", "there is no multi-step scheduling; --async-scheduling overlaps steps instead.",
         ("--num-scheduler-steps", "8")),
    _ign("--num-lookahead-slots", "only speculative decoding used lookahead slots, and it is not built.",
         ("--num-lookahead-slots", "4")),
    _ign("--preemption-mode", "preemption always recomputes (there is no swap space).", ("--preemption-mode", "swap")),
    _ign("--max-parallel-loading-workers", "weights load in one pass per rank.",
         ("--max-parallel-loading-workers", "2")),
    _ign("--disable-sliding-window", "models run with the attention windows their config defines.",
         ("--disable-sliding-window",), kind="switch"),
    _ign("--max-num-partial-prefills", "chunked prefill schedules partial prefills by the token budget alone.",
         ("--max-num-partial-prefills", "2")),
    _ign("--max-long-partial-prefills", "chunked prefill schedules partial prefills by the token budget alone.",
         ("--max-long-partial-prefills", "1")),
    _ign("--prefix-caching-hash-algo", "prefix-cache block hashes are always sha256-based.",
         ("--prefix-caching-hash-algo", "sha256")),
    _ign("--compilation-config", "tokenmill does not use torch.compile; CUDA graphs follow --enforce-eager and "
         "--max-seq-len-to-capture.", ("--compilation-config", '{"level": 3}')),
    _ign("--cuda-graph-sizes", "decode batch sizes captured are 1, 2, 4, 8 and multiples of 16 up to "
         "min(--max-num-seqs, 512); steps with prefill tokens, 16 to 2048 tokens in 19 sizes "
         "(TOKENMILL_MIXED_CUDA_GRAPHS=0: eager).", ("--cuda-graph-sizes", "8")),
    _ign("--guided-decoding-backend", "structured output always uses xgrammar.", ("--guided-decoding-backend",
                                                                                   "outlines")),
    _ign("--structured-outputs-config", "structured output always uses xgrammar.",
         ("--structured-outputs-config", '{"backend": "xgrammar"}')),
    _ign("--response-role", "chat answers always have the role 'assistant'.", ("--response-role", "assistant")),
    _ign("--otlp-traces-endpoint", "OpenTelemetry tracing is not built; use /metrics.",
         ("--otlp-traces-endpoint", "http://127.0.0.1:4317")),
    _ign("--collect-detailed-traces", "OpenTelemetry tracing is not built; use /metrics.",
         ("--collect-detailed-traces", "all")),
    _ign("--calculate-kv-scales", "fp8 KV scales come from the checkpoint (k_scale / v_scale, else 1.0); they "
         "are not computed from the first batch.",
         ("--calculate-kv-scales",), kind="switch"),
    _ign("--limit-mm-per-prompt", "the supported models are text-only.", ("--limit-mm-per-prompt", '{"image": 0}')),
    _ign("--enable-prompt-tokens-details", "usage.prompt_tokens_details.cached_tokens is always reported.",
         ("--enable-prompt-tokens-details",), kind="switch"),
    _ign("--tokenizer-revision", "the tokenizer comes from the model's --revision.",
         ("--tokenizer-revision", "main")),
    _ign("--code-revision", "no remote model code is run.", ("--code-revision", "main")),
    _ign("--ray-workers-use-nsight", "profiling Ray workers is not wired in.", ("--ray-workers-use-nsight",),
         kind="switch"),
    _ign("--worker-use-ray", "pass --distributed-executor-backend ray for Ray.", ("--worker-use-ray",), kind="switch"),
    _ign("--enable-reasoning", "older vLLM's switch: --reasoning-parser alone turns reasoning output on.",
         ("--enable-reasoning",), kind="switch"),
    # --- not built yet: start-up fails ---
    _nb("--enable-lora", "LoRA adapters are not supported yet; merge the adapter into the weights, or serve the "
        "base model.", ("--enable-lora",), kind="switch"),
    _nb("--lora-modules", "LoRA adapters are not supported yet; merge the adapter into the weights, or serve the "
        "base model.", ("--lora-modules", "a=/tmp/a"), kind="values"),
    _nb("--max-loras", "LoRA adapters are not supported yet.", ("--max-loras", "2")),
    _nb("--max-lora-rank", "LoRA adapters are not supported yet.", ("--max-lora-rank", "16")),
    _nb("--speculative-config", "speculative decoding is not supported yet; drop the flag.",
        ("--speculative-config", '{"method": "ngram"}')),
    _nb("--speculative-model", "speculative decoding is not supported yet; drop the flag.",
        ("--speculative-model", "small")),
    _nb("--num-speculative-tokens", "speculative decoding is not supported yet; drop the flag.",
        ("--num-speculative-tokens", "4")),
    _nb("--cpu-offload-gb", "offloading weights to CPU memory is not supported yet; use more GPUs "
        "(--tensor-parallel-size) or a smaller model.", ("--cpu-offload-gb", "4"), inert=("0", "0.0")),
    _nb("--task", "only text generation is built; embedding, scoring and classification models are not "
        "supported yet.", ("--task", "embed"), inert=("auto", "generate")),
    _nb("--runner", "only the generate runner is built; pooling models are not supported yet.",
        ("--runner", "pooling"), inert=("auto", "generate")),
    _nb("--convert", "only text generation is built; converting a model to a pooling model is not supported yet.",
        ("--convert", "embed"), inert=("auto", "none")),
    _nb("--enable-expert-parallel", "expert parallelism is not supported yet; tensor parallelism "
        "(--tensor-parallel-size) already splits every expert across the GPUs.", ("--enable-expert-parallel",),
        kind="switch"),
    _nb("--data-parallel-size", "data parallelism is not supported yet; run one server per GPU group behind a "
        "load balancer.", ("--data-parallel-size", "2"), inert=("1",)),
    _nb("--enable-sleep-mode", "sleep mode is not supported yet.", ("--enable-sleep-mode",), kind="switch"),
    _nb("--hf-overrides", "overriding the model's config is not supported yet; edit a copy of config.json.",
        ("--hf-overrides", '{"rope_scaling": null}')),
    _nb("--rope-scaling", "overriding the model's RoPE scaling is not supported yet; edit rope_scaling in a copy "
        "of config.json.", ("--rope-scaling", '{"rope_type": "dynamic", "factor": 2.0}')),
    _nb("--override-generation-config", "overriding generation_config.json is not supported yet; set the values "
        "per request, or edit a copy of generation_config.json.",
        ("--override-generation-config", '{"temperature": 0.5}')),
    _nb("--model-impl", "only tokenmill's own model code is built (no transformers fallback).",
        ("--model-impl", "transformers"), inert=("auto", "vllm")),
    _nb("--kv-transfer-config", "disaggregated prefill (KV transfer) is not supported yet.",
        ("--kv-transfer-config", '{"kv_connector": "x"}')),
)

BY_FLAG: dict[str, FlagInfo] = {f.flag: f for f in FLAGS}

# Aliases vLLM accepts, added with the flag they alias.
_ALIASES = {"--data-parallel-size": ("-dp",)}


def add_compat_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the ignored and not-built flags to `parser` (all default None: given iff not None)."""
    g = parser.add_argument_group("vLLM flags ignored here or not built yet (see docs/flags.md)")
    for info in FLAGS:
        if info.kind is None:
            continue
        names = (info.flag, *_ALIASES.get(info.flag, ()))
        help_text = ("ignored: " if info.status == "ignored" else "not built: ") + info.note
        if info.kind == "switch":
            g.add_argument(*names, action="store_true", default=None, help=help_text)
        elif info.kind == "values":
            g.add_argument(*names, nargs="+", default=None, help=help_text)
        else:
            g.add_argument(*names, default=None, help=help_text)


def check_compat_flags(values: Mapping[str, Any]) -> list[str]:
    """Log one line per ignored flag that was given; refuse the first not-built one.

    Args:
        values: parsed arguments by dest (`vars(args)`) or `LLM(...)` keyword arguments.

    Returns:
        The dests consumed (ignored or inert not-built ones), so a caller can drop them.

    Raises:
        ValueError: a not-built flag was given a value that asks for it; the
            message is the flag and its table sentence.
    """
    consumed = []
    for info in FLAGS:
        if info.kind is None or values.get(info.dest) is None:
            continue
        value = values[info.dest]
        consumed.append(info.dest)
        if info.status == "ignored":
            logger.warning("%s is ignored: %s", info.flag, info.note)
        elif value is not False and str(value) not in info.inert:
            shown = info.flag if value is True else f"{info.flag} {_show(value)}"
            raise ValueError(f"{shown}: {info.note}")
    return consumed


def _show(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def markdown_table() -> str:
    """The table of docs/flags.md (flag, status, note), in FLAGS order."""
    counts = {s: sum(f.status == s for f in FLAGS) for s in ("implemented", "ignored", "not-built")}
    lines = [f"{len(FLAGS)} flags: {counts['implemented']} implemented, {counts['ignored']} ignored, "
             f"{counts['not-built']} not built.", "", "| flag | status | note |", "|---|---|---|"]
    for f in FLAGS:
        lines.append(f"| `{f.flag}` | {f.status} | {f.note.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
