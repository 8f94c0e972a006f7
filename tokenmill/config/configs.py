"""The resolved engine configs: plain data, importable from every layer.

`ModelConfig`, `CacheConfig`, `SchedulerConfig`, `ParallelConfig`,
`DeviceConfig` and `EngineConfig` (the five together) are what
`tokenmill.config.resolve` builds from `EngineArgs`. This module imports
nothing from tokenmill, so the model loader, executor, worker and scheduler
may import it without a cycle.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.quantization import QuantizationConfig

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


# vLLM's attention backend names without a counterpart here: mapped to the device's default (logged).
VLLM_ATTENTION_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "XFORMERS", "TRITON_ATTN_VLLM_V1", "TORCH_SDPA_VLLM_V1",
                           "FLASH_ATTN_VLLM_V1", "FLEX_ATTENTION")


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
    served_model_name: str = ""  # the first of served_model_names: what responses report
    served_model_names: list[str] = field(default_factory=list)  # every name a request may use
    max_logprobs: int = 20
    trust_remote_code: bool = False
    revision: str | None = None
    chat_template: str | None = None
    tokenizer_mode: str = "auto"  # auto | hf (fast tokenizer) | slow
    # int4/int8 weights: the checkpoint's config as resolved with --quantization; None = 16/32-bit weights
    quantization: QuantizationConfig | None = None


# --gpu-memory-utilization when not given (vLLM's default).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    # --kv-cache-dtype as given (vLLM's name): auto = the model dtype, fp8 / fp8_e4m3 / fp8_e5m2 = 8-bit KV
    # (`dtypes.kv_cache_dtype` turns it into the storage dtype).
    cache_dtype: str = "auto"
    kv_cache_memory_bytes: int | None = None  # explicit KV size (CPU default: from free memory, platforms/memory.py)
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    enable_prefix_caching: bool = True
    num_gpu_blocks: int = 0  # filled after memory profiling
    # Window of the sliding-window KV group (half the layers full attention, half sliding; gpt-oss), whose
    # blocks are freed as the window moves; None = one group (worker/kv_cache.py `sliding_window_group`).
    sliding_window_group: int | None = None


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
    # > 0: a prefill (prompt, or resumed prompt + outputs) takes at most this many tokens per step (vLLM's
    # long_prefill_token_threshold); 0: off.
    long_prefill_token_threshold: int = 0
    # > 0: a step that carries running decodes takes at most this many prefill tokens (stall-free batching,
    # Sarathi-Serve; core/scheduler.py); steps without decodes keep max_num_batched_tokens. 0: off.
    max_prefill_tokens_with_decodes: int = 0
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
    # Steps (decode or mixed) whose longest sequence is longer than this run eagerly (vLLM's max_seq_len_to_capture);
    # None: max_model_len. The graphs read the context lengths from device buffers, so one capture serves any length.
    max_seq_len_to_capture: int | None = None
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
