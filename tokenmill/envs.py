"""Every environment variable tokenmill reads, declared once, read at call time.

Each variable is one function below (docstring: meaning, default, spelling).
Values are read when the function is called, never cached at import, so
`monkeypatch.setenv` in tests and a variable set before a child process
starts both take effect. Code elsewhere in tokenmill calls these functions
instead of `os.environ`; writing variables for child processes
(OMP_NUM_THREADS, NCCL defaults) stays where it happens.

Booleans go through one parser, `get_bool`: 1/true/yes/on and 0/false/no/off
(any case, surrounding blanks ignored); unset or empty means the default; any
other value raises ValueError naming the variable.

Aliases: where vLLM has the same switch, its name is read too, so a vLLM
deployment's environment works unchanged; tokenmill's name wins when both are
set (see `ALIASES`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

# tokenmill's name -> the vLLM name read when tokenmill's is unset or empty.
ALIASES: dict[str, str] = {
    "TOKENMILL_USE_MODELSCOPE": "VLLM_USE_MODELSCOPE",
    "TOKENMILL_API_KEY": "VLLM_API_KEY",
}


def get_str(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of `name`, else of its vLLM alias (`ALIASES`); None when neither is set.

    An empty value counts as unset. `environ` defaults to `os.environ` (read now).
    """
    env = os.environ if environ is None else environ
    for key in (name, ALIASES.get(name)):
        if key is not None and (value := env.get(key)):
            return value
    return None


def get_bool(name: str, default: bool, environ: Mapping[str, str] | None = None) -> bool:
    """`name` (or its alias) parsed as a boolean; `default` when unset or empty.

    Raises:
        ValueError: the value is not one of 1/true/yes/on or 0/false/no/off (any case).
    """
    env = os.environ if environ is None else environ
    for key in (name, ALIASES.get(name)):
        if key is None or not (raw := env.get(key, "").strip()):
            continue
        value = raw.lower()
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        raise ValueError(f"Environment variable {key}={raw!r} is not a boolean; use one of "
                         f"{'/'.join(_TRUE)} or {'/'.join(_FALSE)}.")
    return default


def get_int(name: str, environ: Mapping[str, str] | None = None) -> int | None:
    """`name` parsed as an integer; None when unset or empty.

    Raises:
        ValueError: the value is not an integer.
    """
    raw = get_str(name, environ)
    if raw is None:
        return None
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"Environment variable {name}={raw!r} is not an integer.") from None


# ---- paths -------------------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """TOKENMILL_CACHE_DIR: root of tokenmill's own caches (compiled CPU kernels under `kernels/`,
    GGUF configs under `gguf_configs/`, tokenizers); default `~/.cache/tokenmill`."""
    root = get_str("TOKENMILL_CACHE_DIR")
    return Path(root) if root else Path(os.path.expanduser("~")) / ".cache" / "tokenmill"


# ---- CPU -------------------------------------------------------------------------------------------------------


def cpu_threads() -> int | None:
    """TOKENMILL_CPU_THREADS: torch threads of a CPU worker (None: torch's default, or the cores split
    between tensor-parallel ranks). Raises ValueError when not an integer."""
    return get_int("TOKENMILL_CPU_THREADS")


def cpu_kernels() -> bool:
    """TOKENMILL_CPU_KERNELS: build and use the C kernels on CPU (default on; off keeps the PyTorch ops)."""
    return get_bool("TOKENMILL_CPU_KERNELS", True)


def cpu_pack_weights() -> bool:
    """TOKENMILL_CPU_PACK_WEIGHTS: repack bfloat16 linear weights into oneDNN's layout once at load
    (default on)."""
    return get_bool("TOKENMILL_CPU_PACK_WEIGHTS", True)


def cpu_malloc_tuning() -> bool:
    """TOKENMILL_CPU_MALLOC_TUNING: let glibc keep freed activation memory between steps (default on;
    see `platforms.cpu.tune_malloc`)."""
    return get_bool("TOKENMILL_CPU_MALLOC_TUNING", True)


def cpu_adaptive_threads() -> bool:
    """TOKENMILL_CPU_ADAPTIVE_THREADS: a CPU worker lowers its torch threads to the CPUs other processes leave
    free, re-estimated each second, and raises them back (default on; `worker/cpu_threads.py`)."""
    return get_bool("TOKENMILL_CPU_ADAPTIVE_THREADS", True)


def omp_wait_policy(environ: Mapping[str, str] | None = None) -> str | None:
    """OMP_WAIT_POLICY as the user set it (None when unset). When it and GOMP_SPINCOUNT are both unset, the
    engine core process sets GOMP_SPINCOUNT=`DEFAULT_GOMP_SPINCOUNT` (`engine/core_proc.py`)."""
    return get_str("OMP_WAIT_POLICY", environ)


# libgomp's spin rounds before a waiting thread sleeps, the engine core's default: long enough to bridge
# the gaps between the parallel regions of one decode step, short enough that a thread whose teammate
# lost its core soon yields it (docs/benchmarks.md, "OpenMP wait policy at concurrency 1").
DEFAULT_GOMP_SPINCOUNT = 30000


def gomp_spincount(environ: Mapping[str, str] | None = None) -> str | None:
    """GOMP_SPINCOUNT as the user set it (None when unset): libgomp's spin rounds before a waiting thread
    sleeps (`engine/core_proc.py` defaults it to `DEFAULT_GOMP_SPINCOUNT` when OMP_WAIT_POLICY is unset too)."""
    return get_str("GOMP_SPINCOUNT", environ)


def cpu_gguf_kernels() -> bool:
    """TOKENMILL_CPU_GGUF_KERNELS: on the CPU, keep a GGUF file's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q6_K linear weights
    and LM head quantized and multiply them with the C kernels (default on); 0 dequantizes them at load
    into the model dtype."""
    return get_bool("TOKENMILL_CPU_GGUF_KERNELS", True)


def cpu_fused_decode() -> bool:
    """TOKENMILL_CPU_FUSED_DECODE: on the CPU, run a one-token step of a Llama-style float32 model whose linear
    weights are kept as GGUF blocks through its whole decoder stack in one C call
    (`kernels/cpu/decoder_step.c`; default on); 0 keeps the module-by-module path."""
    return get_bool("TOKENMILL_CPU_FUSED_DECODE", True)


def cc() -> str:
    """CC: the C compiler for the CPU kernels (default `cc`, then gcc or clang when it is missing)."""
    return get_str("CC") or "cc"


def omp_num_threads() -> str | None:
    """OMP_NUM_THREADS as the user set it (None when unset); tokenmill only sets a default for children."""
    return get_str("OMP_NUM_THREADS")


# ---- GPU -------------------------------------------------------------------------------------------------------


def disable_fused_kernels() -> bool:
    """TOKENMILL_DISABLE_FUSED_KERNELS: run RMSNorm, RoPE, gated activations (the MoE's too) and MoE
    routing as PyTorch ops on CUDA too (default off; for bisecting a numerical difference or a broken
    Triton). The GEMM kernels (attention, fused-MoE grouped GEMMs, quantized linears) stay Triton."""
    return get_bool("TOKENMILL_DISABLE_FUSED_KERNELS", False)


def force_cc70() -> bool:
    """TOKENMILL_FORCE_CC70: treat every GPU as compute capability 7.0 (V100) so the old-GPU paths
    (float16, no FlashAttention, unpipelined Triton) can be tested on a new one (default off)."""
    return get_bool("TOKENMILL_FORCE_CC70", False)


def mixed_cuda_graphs() -> bool:
    """TOKENMILL_MIXED_CUDA_GRAPHS: besides decode-only steps, also replay CUDA graphs for steps with prefill
    tokens (any mix of requests, up to `worker.cuda_graph.MIXED_MAX_TOKENS` tokens, padded to a captured
    size); default on. Off: such steps run eagerly (their host time, ~1 ms a layer, then shows in TTFT)."""
    return get_bool("TOKENMILL_MIXED_CUDA_GRAPHS", True)


def triton_interpret() -> bool:
    """TRITON_INTERPRET: Triton runs kernels in its NumPy interpreter on the CPU (set by the tests);
    the kernels then skip libdevice. Default off."""
    return get_bool("TRITON_INTERPRET", False)


def cuda_visible_devices() -> str | None:
    """CUDA_VISIBLE_DEVICES as set (None when unset); only read for messages."""
    return get_str("CUDA_VISIBLE_DEVICES")


# ---- processes, logging, metrics -------------------------------------------------------------------------------


def logging_level() -> str:
    """TOKENMILL_LOGGING_LEVEL: log level of worker processes (default WARNING)."""
    return get_str("TOKENMILL_LOGGING_LEVEL") or "WARNING"


def worker_stats() -> bool:
    """TOKENMILL_WORKER_STATS: workers log their busy/idle time per step window (default off)."""
    return get_bool("TOKENMILL_WORKER_STATS", False)


def metrics_vllm_names() -> bool:
    """TOKENMILL_METRICS_VLLM_NAMES: /metrics also exports every metric under vLLM's `vllm:` names
    (default off)."""
    return get_bool("TOKENMILL_METRICS_VLLM_NAMES", False)


def ray_address() -> str | None:
    """RAY_ADDRESS: the Ray cluster to join for multi-node runs (None: Ray's own discovery)."""
    return get_str("RAY_ADDRESS")


# ---- model download, serving ------------------------------------------------------------------------------------


def default_host() -> str:
    """TOKENMILL_HOST: the address `--host` defaults to (default 127.0.0.1, local clients only; the container
    images set 0.0.0.0 so that `docker run -p` reaches the server as with vLLM's image)."""
    return get_str("TOKENMILL_HOST") or "127.0.0.1"


def use_modelscope() -> bool:
    """TOKENMILL_USE_MODELSCOPE (alias VLLM_USE_MODELSCOPE): download repo ids from ModelScope instead of
    the Hugging Face Hub (default off)."""
    return get_bool("TOKENMILL_USE_MODELSCOPE", False)


def api_key(environ: Mapping[str, str] | None = None) -> str | None:
    """TOKENMILL_API_KEY (alias VLLM_API_KEY): the server's API key when no --api-key is given
    (None: no authentication). An empty TOKENMILL_API_KEY counts as unset; an empty VLLM_API_KEY is
    returned as "" so that the caller can refuse it."""
    env = os.environ if environ is None else environ
    return env.get("TOKENMILL_API_KEY") or env.get(ALIASES["TOKENMILL_API_KEY"])


def openai_api_key() -> str | None:
    """OPENAI_API_KEY: the key `tokenmill bench serve` sends to the server (None: none sent)."""
    return get_str("OPENAI_API_KEY")
