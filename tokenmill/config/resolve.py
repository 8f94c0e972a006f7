"""Resolve `EngineArgs` into an `EngineConfig`: model files, device, dtype, limits, defaults.

Per-device scheduler defaults are vLLM's (`vllm/engine/arg_utils.py`,
`_set_default_args`), keyed by usage ("llm" offline, "server" OpenAI):

    device               max_num_batched_tokens (llm / server)   max_num_seqs (llm / server)
    CPU                  4096 / 2048                             256 / 128
    CUDA, >= 70 GiB      16384 / 8192                            1024 / 1024
    CUDA, smaller        8192 / 2048                             256 / 256

`max_prefill_tokens_with_decodes` (tokenmill's own, no vLLM default to follow):
2048 for the server on CUDA >= 70 GiB, else 0 (off); see
`default_prefill_tokens_with_decodes`.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from tokenmill.config.configs import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    parse_size,
)
from tokenmill.dtypes import DTYPE_ALIASES, KV_CACHE_DTYPES, dtype_name, kv_cache_dtype, normalize_kv_cache_dtype
from tokenmill.model_loader.hf_config import load_generation_config, load_hf_config
from tokenmill.model_loader.source import BUNDLED_MODEL_NAME, ModelSource, resolve_model_source
from tokenmill.models.registry import get_supported_archs, resolve_model_cls
from tokenmill.platforms import current_platform
from tokenmill.platforms.cuda import force_cc70_requested
from tokenmill.platforms.interface import Platform

if TYPE_CHECKING:
    from tokenmill.config.args import EngineArgs
    from tokenmill.quantization import QuantizationConfig

logger = logging.getLogger(__name__)

_LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy", "pt")
# HF config keys that bound the context length (vLLM's _get_and_verify_max_len list, abridged).
_MAX_LEN_KEYS = ("max_position_embeddings", "max_sequence_length", "max_seq_len", "seq_length", "n_positions")
_LARGE_GPU_BYTES = 70 * 1024**3


def resolve_engine_config(args: EngineArgs, usage: str = "llm") -> EngineConfig:
    """Resolve `args` into configs (downloads the model if it is a hub repo id).

    Args:
        args: the user's arguments.
        usage: "llm" (offline) or "server"; selects the scheduler defaults.

    Raises:
        ValueError: an invalid argument, an unsupported architecture, a
            dtype the device lacks, or a max_model_len beyond the model's.
    """
    _validate_args(args, usage)
    source = resolve_model_source(args.model, args.revision, args.download_dir, args.load_format)
    hf_config = load_hf_config(source, args.revision, args.trust_remote_code)
    architecture = _resolve_architecture(hf_config)
    platform = current_platform(args.device)
    if platform.device_type == "cuda":  # fail now, not with "no kernel image is available" later
        from tokenmill.platforms.cuda import check_visible_gpus

        check_visible_gpus()
    quantization = _resolve_quantization(args, source, hf_config, platform)
    dtype = _resolve_dtype(args.dtype, platform, architecture, quantization)
    max_model_len = _resolve_max_model_len(hf_config, args.max_model_len)
    _verify_parallel(args, hf_config, platform)
    served_names = _served_model_names(args)
    if args.tokenizer_mode == "slow":
        logger.warning("--tokenizer-mode slow is ignored: the incremental detokenizer needs the fast Hugging Face "
                       "tokenizer, which gives the same tokens.")
    model_config = ModelConfig(
        model=args.model if args.model is not None else BUNDLED_MODEL_NAME,
        model_path=source.weights_path,
        gguf_file=source.gguf_file,
        tokenizer=None if args.skip_tokenizer_init else (args.tokenizer or source.weights_path),
        skip_tokenizer_init=args.skip_tokenizer_init,
        load_format=args.load_format,
        dtype=dtype_name(dtype),
        seed=args.seed,
        max_model_len=max_model_len,
        architecture=architecture,
        hf_config=hf_config,
        generation_config=_resolve_generation_config(args.generation_config, source),
        served_model_name=served_names[0],
        served_model_names=served_names,
        max_logprobs=args.max_logprobs,
        trust_remote_code=args.trust_remote_code,
        revision=args.revision,
        chat_template=args.chat_template,
        tokenizer_mode=args.tokenizer_mode,
        quantization=quantization,
    )
    return EngineConfig(
        model_config=model_config,
        cache_config=_resolve_cache_config(args, platform, hf_config),
        scheduler_config=_resolve_scheduler_config(args, platform, usage, max_model_len),
        parallel_config=ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            distributed_executor_backend=args.distributed_executor_backend,
            disable_custom_all_reduce=bool(args.disable_custom_all_reduce),
        ),
        device_config=DeviceConfig(
            device=platform.device_type,
            attention_backend=_resolve_attention_backend(args.attention_backend, platform),
            enforce_eager=args.enforce_eager,
            max_seq_len_to_capture=args.max_seq_len_to_capture,
            force_cc70=platform.device_type == "cuda" and force_cc70_requested(),
        ),
    )


def _validate_args(args: EngineArgs, usage: str) -> None:
    if usage not in ("llm", "server"):
        raise ValueError(f"usage must be 'llm' or 'server', got {usage!r}.")
    if args.block_size < 1 or args.block_size & (args.block_size - 1):
        raise ValueError(f"--block-size must be a power of two >= 1 (e.g. 16), got {args.block_size}.")
    if args.tensor_parallel_size < 1 or args.pipeline_parallel_size < 1:
        raise ValueError("--tensor-parallel-size and --pipeline-parallel-size must be >= 1, got "
                         f"{args.tensor_parallel_size} and {args.pipeline_parallel_size}.")
    if args.gpu_memory_utilization is not None and not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}.")
    if args.load_format not in _LOAD_FORMATS:
        raise ValueError(f"--load-format must be one of {', '.join(_LOAD_FORMATS)}, got {args.load_format!r}.")
    if args.dtype != "auto" and args.dtype not in DTYPE_ALIASES:
        raise ValueError(f"--dtype must be auto or one of {', '.join(DTYPE_ALIASES)}, got {args.dtype!r}.")
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        raise ValueError(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}.")
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 1:
        raise ValueError(f"--max-num-batched-tokens must be >= 1, got {args.max_num_batched_tokens}.")
    if args.max_model_len is not None and args.max_model_len < 1:
        raise ValueError(f"--max-model-len must be >= 1, got {args.max_model_len}.")
    if args.max_logprobs < 0:
        raise ValueError(f"--max-logprobs must be >= 0, got {args.max_logprobs}.")
    if args.tokenizer_mode not in ("auto", "hf", "slow"):
        raise ValueError(f"--tokenizer-mode {args.tokenizer_mode} is not supported; use auto (the fast Hugging Face "
                         "tokenizer) or slow.")
    if args.max_seq_len_to_capture is not None and args.max_seq_len_to_capture < 1:
        raise ValueError(f"--max-seq-len-to-capture must be >= 1, got {args.max_seq_len_to_capture}.")
    kv_cache_dtype(args.kv_cache_dtype, torch.float32)  # an unknown name fails here, before anything loads
    if args.long_prefill_token_threshold < 0:
        raise ValueError(f"--long-prefill-token-threshold must be >= 0, got {args.long_prefill_token_threshold}.")
    if args.long_prefill_token_threshold and not args.enable_chunked_prefill:
        raise ValueError("--long-prefill-token-threshold splits prompts over steps, which needs chunked prefill; "
                         "drop --no-enable-chunked-prefill or the threshold.")
    cap = args.max_prefill_tokens_with_decodes
    if cap is not None and cap < 0:
        raise ValueError(f"--max-prefill-tokens-with-decodes must be >= 0 (0: off), got {cap}.")
    if cap and not args.enable_chunked_prefill:
        raise ValueError("--max-prefill-tokens-with-decodes splits prompts over steps, which needs chunked prefill; "
                         "drop --no-enable-chunked-prefill or the cap.")
    if args.scheduling_policy not in ("fcfs", "priority"):
        raise ValueError(f"--scheduling-policy must be fcfs or priority, got {args.scheduling_policy!r}.")


def _served_model_names(args: EngineArgs) -> list[str]:
    """--served-model-name as a list (one or several names), default the model argument."""
    names = args.served_model_name
    if isinstance(names, str):
        names = [names]
    if not names:
        names = [args.model if args.model is not None else BUNDLED_MODEL_NAME]
    return list(dict.fromkeys(names))  # repeated names once, order kept


def _resolve_attention_backend(requested: str | None, platform: Platform) -> str | None:
    """tokenmill's backend name, or None (the device's default); vLLM-only names map to the device's best, logged."""
    from tokenmill.config.configs import VLLM_ATTENTION_BACKENDS

    from tokenmill.attention.selector import BACKEND_NAMES

    if requested is None or requested.upper() in BACKEND_NAMES:
        return requested
    if requested.upper() not in VLLM_ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend {requested} is not known; use TORCH_SDPA or TRITON_ATTN, or leave it "
                         "out for this device's default.")
    best = "TRITON_ATTN" if platform.device_type == "cuda" else "TORCH_SDPA"
    logger.info("--attention-backend %s is vLLM's; tokenmill does not have it and uses this device's best "
                "backend, %s.", requested, best)
    return best


def _verify_parallel(args: EngineArgs, hf_config: Any, platform: Platform) -> None:
    """Start-up checks of tensor/pipeline parallel sizes against the model and the host.

    Raises:
        ValueError: sizes that do not split the heads/MLP/layers (naming sizes
            that work), a backend that cannot run them, more ranks than GPUs,
            or pipeline parallelism on a model class without it.
    """
    from tokenmill.distributed.partition import verify_parallel_sizes
    from tokenmill.executor import get_executor_class

    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    verify_parallel_sizes(hf_config, tp, pp)
    backend = args.distributed_executor_backend
    get_executor_class(ParallelConfig(tp, pp, backend))  # unknown / unavailable backends fail here
    if platform.device_type == "cuda" and backend != "ray" and tp * pp > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {tp * pp} ranks need {tp * pp} GPUs, but "
                         f"this host has {torch.cuda.device_count()} visible; lower the sizes or use "
                         "--distributed-executor-backend ray on a multi-host Ray cluster.")
    if pp > 1:
        from tokenmill.models.registry import resolve_model_cls

        model_cls, arch = resolve_model_cls(getattr(hf_config, "architectures", None))
        if not getattr(model_cls, "supports_pp", False):
            raise ValueError(f"{arch} does not support pipeline parallelism yet; use --pipeline-parallel-size 1 "
                             "(tensor parallelism works).")


def _resolve_architecture(hf_config: Any) -> str:
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in get_supported_archs():
            return arch
    raise ValueError(f"Model architecture(s) {archs} are not supported by tokenmill. "
                     f"Supported architectures: {', '.join(get_supported_archs())}.")


def _resolve_quantization(args: EngineArgs, source: ModelSource, hf_config: Any,
                          platform: Platform) -> QuantizationConfig | None:
    """The checkpoint's int4/int8 / FP8 config confirmed (or overridden) by --quantization, checked against the device.

    Returns a `tokenmill.quantization.QuantizationConfig`, or None for 16/32-bit weights.

    Raises:
        ValueError: --quantization disagrees with the checkpoint or names no
            method, the checkpoint's config is malformed, or this device cannot
            run the method (one sentence naming the device, the method and what works there).
    """
    if source.gguf_file is not None:
        if args.quantization is not None:
            raise ValueError(f"--quantization {args.quantization} does not apply to a GGUF file (it carries its own "
                             "quantization, read from the file); drop the flag.")
        return None
    from tokenmill.quantization import check_supported, find_quantization_config, resolve_quantization
    from tokenmill.quantization.config import ALIASES

    raw = find_quantization_config(source.weights_path, hf_config)
    if raw is None and args.quantization is None:
        return None
    if raw is None and args.load_format == "dummy":  # speed runs from a bare config.json
        method = ALIASES.get(args.quantization.lower(), args.quantization.lower())
        raw = _DUMMY_QUANTIZATION.get(method)
        if raw is not None:
            logger.info("--load-format dummy --quantization %s: random weights quantized as a 4-bit, group-128 "
                        "%s checkpoint (put a quantization_config in config.json for another scheme)",
                        args.quantization, method)
    cfg = resolve_quantization(raw, args.quantization)
    if cfg is not None:
        capability = platform.get_device_capability() if platform.device_type == "cuda" else None
        check_supported(cfg, platform.device_type, capability)
        if cfg.is_fp8 and cfg.activation_scheme and capability is not None and tuple(capability) < (8, 9):
            logger.info("FP8 W8A8 checkpoint on compute capability %d.%d (no FP8 arithmetic before 8.9): it runs "
                        "weight-only, activations stay 16-bit", capability[0], capability[1])
    return cfg


# The scheme dummy weights get from `--quantization` alone (the usual published W4A16 g128 checkpoints).
_DUMMY_QUANTIZATION = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False},
    "compressed-tensors": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                           "quantization_status": "compressed", "ignore": ["lm_head"], "config_groups": {
                               "group_0": {"targets": ["Linear"], "weights": {
                                   "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                   "group_size": 128}}}},
}

# vLLM's AWQ and GPTQ kernels take float16 activations; with --dtype auto a GPU follows them.
_FP16_METHODS = ("awq", "gptq")


def _resolve_dtype(requested: str, platform: Platform, architecture: str | None = None,
                   quantization: QuantizationConfig | None = None) -> torch.dtype:
    # Model classes with `fp16_unsafe = True` (Gemma 3: activations overflow fp16) never get fp16 from "auto".
    fp16_unsafe = bool(architecture) and getattr(resolve_model_cls([architecture])[0], "fp16_unsafe", False)
    if requested == "auto" and quantization is not None and quantization.method in _FP16_METHODS \
            and platform.device_type == "cuda" and not fp16_unsafe:
        logger.info("dtype auto -> float16: %s checkpoints run in float16 on GPUs (as vLLM)", quantization.method)
        return torch.float16
    if requested == "auto":
        dtype = platform.default_dtype()
        if dtype == torch.float16 and fp16_unsafe:
            dtype = torch.bfloat16 if torch.bfloat16 in platform.supported_dtypes() else torch.float32
            logger.info("dtype auto -> %s: %s overflows in float16", dtype_name(dtype), architecture)
            return dtype
        logger.info("dtype auto -> %s", platform.default_dtype_reason() or dtype_name(dtype))
        return dtype
    dtype = DTYPE_ALIASES[requested]
    if dtype not in platform.supported_dtypes():
        raise ValueError(f"{platform.get_device_name()} does not support {dtype_name(dtype)} "
                         f"(compute capability {platform.get_device_capability()}); use --dtype float16.")
    if dtype == torch.float16 and fp16_unsafe:
        logger.warning("--dtype float16 with %s: its activations are known to overflow in float16 "
                       "(inf/NaN outputs); prefer bfloat16 or float32.", architecture)
    if dtype == torch.float16 and platform.device_type == "cpu":
        # vLLM guides for V100s pass --dtype half; it runs here, but most CPUs convert float16 in software.
        logger.info("--dtype float16 on CPU: supported, but most CPUs have no float16 arithmetic, so it runs slower "
                    "than float32 (the CPU default, --dtype auto); it halves weight and KV-cache memory.")
    return dtype


def model_max_len(hf_config: Any) -> int:
    """The longest context the model supports: the smallest of its length keys (2048 if none)."""
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    limits = [v for key in _MAX_LEN_KEYS if isinstance(v := getattr(text_config, key, None), int) and v > 0]
    return min(limits) if limits else 2048


def _resolve_max_model_len(hf_config: Any, requested: int | None) -> int:
    limit = model_max_len(hf_config)
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"--max-model-len {requested} is larger than the model's maximum context length "
                         f"{limit}; pass --max-model-len {limit} or less.")
    return requested


def _resolve_generation_config(setting: str, source: ModelSource) -> dict[str, Any]:
    if setting == "vllm":
        return {}
    if setting == "auto":
        return load_generation_config(source)
    if not os.path.isdir(setting):
        raise ValueError(f"--generation-config must be auto, vllm or a folder with generation_config.json, got {setting!r}.")
    return load_generation_config(ModelSource(path=setting))


def _resolve_cache_config(args: EngineArgs, platform: Platform, hf_config: Any = None) -> CacheConfig:
    from tokenmill.worker.kv_cache import sliding_window_group

    # None on CPU: the worker sizes it from the memory left after the weights (platforms/memory.py).
    kv_bytes = parse_size(args.kv_cache_memory_bytes) if args.kv_cache_memory_bytes is not None else None
    if kv_bytes is not None and kv_bytes <= 0:
        raise ValueError(f"--kv-cache-memory-bytes must be positive, got {args.kv_cache_memory_bytes}.")
    window = None
    if hf_config is not None and not args.disable_hybrid_kv_cache_manager:
        window = sliding_window_group(hf_config, args.pipeline_parallel_size)
    prefix_caching = args.enable_prefix_caching
    if window is not None:
        logger.info("KV cache: sliding-window layers keep only their last %d tokens' blocks (two KV groups; "
                    "--disable-hybrid-kv-cache-manager keeps one group, full-length KV on every layer)", window)
    utilization = args.gpu_memory_utilization
    if utilization is not None and platform.device_type == "cpu":
        logger.info("--gpu-memory-utilization %s is for GPUs and is not used on CPU: the KV cache is sized by "
                    "--kv-cache-memory-bytes (default: 0.4 x available memory, at most 16 GiB)", utilization)
    cache_dtype = normalize_kv_cache_dtype(args.kv_cache_dtype)
    if cache_dtype != "auto":
        logger.info("KV cache dtype %s (%s): K and V stored in 8 bits, scaled per layer by the checkpoint's "
                    "k_scale / v_scale (1.0 where it has none)", cache_dtype, dtype_name(KV_CACHE_DTYPES[cache_dtype]))
    return CacheConfig(
        block_size=args.block_size,
        cache_dtype=cache_dtype,
        kv_cache_memory_bytes=kv_bytes,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        gpu_memory_utilization=DEFAULT_GPU_MEMORY_UTILIZATION if utilization is None else utilization,
        enable_prefix_caching=prefix_caching,
        sliding_window_group=window,
    )


def _large_device_memory(platform: Platform) -> bool:
    """The device has >= 70 GiB (vLLM's line between its two GPU default sets)."""
    return (platform.total_memory_bytes() or 0) >= _LARGE_GPU_BYTES


def default_scheduler_limits(platform: Platform, usage: str) -> tuple[int, int]:
    """vLLM's (max_num_batched_tokens, max_num_seqs) defaults for this device and usage."""
    server = usage == "server"
    if platform.device_type == "cpu":
        return (2048, 128) if server else (4096, 256)
    if _large_device_memory(platform):
        return (8192, 1024) if server else (16384, 1024)
    return (2048, 256) if server else (8192, 256)


def default_prefill_tokens_with_decodes(platform: Platform, usage: str) -> int:
    """The default `max_prefill_tokens_with_decodes`: 2048 for the server on CUDA >= 70 GiB, else 0 (off).

    Why 2048 there: the server's step budget is 8192 tokens, and a step with
    ~8192 prefill tokens costs about 8192 x 16 GFLOP (Llama-3.1-8B, 2 x 8 B
    parameters per token) = 131 TFLOP, an estimated ~165 ms of GEMMs at an
    H200's ~800 TFLOP/s, which every running decode waits for (issue 24 asks
    for ITL p99 <= 150 ms at concurrency 512). 2048 prefill tokens are ~33
    TFLOP, an estimated ~40-50 ms beside the decodes' own ~20-25 ms, while
    prefills still move at 2048 tokens a step. (Estimates; the measured
    A/B is in docs/benchmarks.md, twelfth session.) 2048 is also `worker/cuda_graph.py` MIXED_MAX_TOKENS, the
    largest mixed step captured as a CUDA graph, because above it a step's
    GPU time exceeds the host's eager launch cost (that module's docstring);
    with decodes beside the capped chunk a step is larger and runs eagerly,
    as the full-budget step did.
    Offline (`LLM`) keeps the whole budget (throughput over latency), and so
    do CPUs and smaller GPUs (whose server budget, 2048, is no larger than
    the cap would be).
    """
    return 2048 if usage == "server" and platform.device_type == "cuda" and _large_device_memory(platform) else 0


def _resolve_scheduler_config(args: EngineArgs, platform: Platform, usage: str, max_model_len: int) -> SchedulerConfig:
    default_tokens, default_seqs = default_scheduler_limits(platform, usage)
    max_num_seqs = args.max_num_seqs or default_seqs
    max_num_batched_tokens = args.max_num_batched_tokens or default_tokens
    if not args.enable_chunked_prefill:
        # Without chunking a whole prompt must fit in one step.
        if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < max_model_len:
            raise ValueError(f"With chunked prefill disabled, --max-num-batched-tokens ({args.max_num_batched_tokens}) "
                             f"must be >= --max-model-len ({max_model_len}); raise it or lower --max-model-len.")
        max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
    prefill_cap = args.max_prefill_tokens_with_decodes
    if prefill_cap is None:
        prefill_cap = default_prefill_tokens_with_decodes(platform, usage) if args.enable_chunked_prefill else 0
        if prefill_cap >= max_num_batched_tokens:
            prefill_cap = 0  # a cap at or above the budget caps nothing
        if prefill_cap:
            logger.info("Steps that carry running decodes take at most %d prefill tokens (of a %d-token budget), so "
                        "long prompts do not stall them; --max-prefill-tokens-with-decodes 0 turns this off",
                        prefill_cap, max_num_batched_tokens)
    elif prefill_cap > max_num_batched_tokens:
        raise ValueError(f"--max-prefill-tokens-with-decodes ({prefill_cap}) must be at most --max-num-batched-tokens "
                         f"({max_num_batched_tokens}), the whole step's budget; lower it, or pass 0 to turn it off.")
    return SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        max_prefill_tokens_with_decodes=prefill_cap,
        policy=args.scheduling_policy,
        async_scheduling=_resolve_async_scheduling(args, platform),
    )


def _resolve_async_scheduling(args: EngineArgs, platform: Platform) -> bool:
    """`--async-scheduling` as given; by default on for one CUDA device (in-process worker), off elsewhere.

    On a CPU the host is the device, so overlapping them gains nothing; the
    multi-process and Ray executors run steps synchronously.
    """
    if args.async_scheduling is not None:
        return bool(args.async_scheduling)
    single = args.tensor_parallel_size * args.pipeline_parallel_size == 1
    return platform.device_type == "cuda" and single and args.distributed_executor_backend in (None, "uni")
