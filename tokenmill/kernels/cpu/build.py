"""Build and load tokenmill's C kernels for the CPU (decode attention, RMSNorm, SiLU-and-mul, RoPE, KV writes).

Each kernel is one C source beside its Python wrapper. `load_library(source)`
compiles it with the system C compiler (`$CC`, else `cc`, `gcc` or `clang`)
and `-O3 -march=native -fopenmp -ffp-contract=off` into
`$TOKENMILL_CACHE_DIR/kernels` (default `~/.cache/tokenmill/kernels`), named
by a hash of the source, the shared header `simd.h`, the flags, the
compiler's version and this CPU's feature flags (a source that includes
another kernel's .c file, as `decoder_step.c` does, is hashed with it), so later processes load the
cached library at once (a build takes ~1-10 s). Builds go
to a temporary file that is renamed into place, so processes that build at
once never load a partial file. A cached library is loaded only when this
user owns it (another user's file in a shared cache is rebuilt under a
per-user name instead: loading it would run their code); one that fails to
load is rebuilt once.

No compiler, a failed build, or env `TOKENMILL_CPU_KERNELS=0` -> None
(logged once per source), and each caller keeps its PyTorch path. Built by
GCC, the libraries need libgomp.so.1, which the dynamic loader resolves to
the copy torch already loaded where the sonames match (pip's x86 torch), so
`torch.set_num_threads` sets their thread count too.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from tokenmill import envs

logger = logging.getLogger(__name__)

CPU_KERNELS_ENV = "TOKENMILL_CPU_KERNELS"
# -ffp-contract=off: GCC would otherwise fuse a * b + c written with separate intrinsics into one FMA,
# skipping the rounding of a * b that the PyTorch reference does (the kernels call fmadd where they mean it).
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared", "-std=gnu11")

# Headers the sources include (simd.h), found with -I here; hashed with every source.
INCLUDE_DIR = Path(__file__).resolve().parent

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)

# source path -> the loaded library, or None once a load failed or was turned off (tried once per process)
_loaded: dict[Path, ctypes.CDLL | None] = {}
_lock = threading.Lock()


def _cache_dir() -> Path:
    return envs.cache_dir() / "kernels"


def _compiler() -> str | None:
    return shutil.which(envs.cc()) or shutil.which("gcc") or shutil.which("clang")


def _cpu_flags() -> str:
    """This CPU's feature flags (Linux), so a shared cache never hands a -march=native build to another CPU."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _local_sources(source: Path) -> list[Path]:
    """`source` and the .c files of this folder it includes (`#include "x.c"`, recursively), in include order."""
    seen = [source]
    for path in seen:
        for name in _INCLUDE.findall(path.read_text(encoding="utf-8", errors="replace")):
            dep = INCLUDE_DIR / name
            if name.endswith(".c") and dep.is_file() and dep not in seen:
                seen.append(dep)
    return seen


def _build(source: Path, compiler: str) -> Path:
    """Compile (or find) the library of `source`; returns its path. Raises OSError / subprocess errors."""
    text = b"".join(p.read_bytes() for p in _local_sources(source)) + b"".join(
        h.read_bytes() for h in sorted(INCLUDE_DIR.glob("*.h")))
    version = subprocess.run([compiler, "--version"], capture_output=True, encoding="utf-8", errors="replace",
                             check=False, timeout=30).stdout
    key = hashlib.sha256(b"\0".join([text, " ".join(FLAGS).encode(), version.encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}-{key}.so"
    if target.exists() and hasattr(os, "getuid") and target.stat().st_uid != os.getuid():
        target = target.with_name(f"{source.stem}-{key}-uid{os.getuid()}.so")
    if target.exists():
        return target
    logger.info("Building the CPU kernel %s with %s (once per machine; cached in %s) ...", source.name, compiler,
                target.parent)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, f"-I{INCLUDE_DIR}", str(source), "-o", tmp, "-lm"], check=True,
                       capture_output=True, encoding="utf-8", errors="replace", timeout=300)
        os.chmod(tmp, 0o755)  # mkstemp made it 0600
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load_library(source: Path, configure: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL | None:
    """The compiled library of the C file `source`, built on the first call; None when unavailable.

    `configure(lib)` sets the functions' ctypes signatures before any other
    thread can see the library. The answer is cached per process: a failed
    build is not retried.
    """
    lib = _loaded.get(source, False)
    if lib is not False:
        return lib
    with _lock:
        if source not in _loaded:
            _loaded[source] = _load(source, configure)
        return _loaded[source]


def _load(source: Path, configure: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL | None:
    if not envs.cpu_kernels():
        logger.info("%s=0: %s runs as PyTorch ops.", CPU_KERNELS_ENV, source.stem)
        return None
    compiler = _compiler()
    if compiler is None:
        logger.info("No C compiler found: %s runs as PyTorch ops (slower).", source.stem)
        return None
    try:
        path = _build(source, compiler)
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:  # a damaged cached file: build it again
            path.unlink(missing_ok=True)
            lib = ctypes.CDLL(str(_build(source, compiler)))
        configure(lib)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        logger.warning("Building the CPU kernel %s failed; using PyTorch ops (slower). %s", source.name,
                       str(detail).strip()[-500:])
        return None
    logger.info("CPU kernel %s: %s", source.stem, lib._name)
    return lib
