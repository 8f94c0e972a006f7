"""Running a script that compiles Triton kernels for an explicit GPUTarget (the `*_compile*` tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def compile_in_subprocess(script: str, timeout: int = 600) -> list[dict]:
    """Run `script` in a fresh Python without TRITON_INTERPRET (so triton.compile lowers to PTX / cubins),
    with this checkout and this folder (so the script can import `compile_with_ptxas`) first on PYTHONPATH;
    returns the JSON list its last stdout line prints.

    Raises:
        AssertionError: the script failed (the tail of its stderr is the message).
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", script], env=env, check=False, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# Runs each script of a JSON list {key: script} (stdin) in its own namespace, stdout captured; prints
# {key: [True, its last stdout line's JSON] or [False, its traceback]}.
_BATCH_RUNNER = """
import contextlib, io, json, sys, traceback
out = {}
for key, script in json.load(sys.stdin).items():
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            exec(compile(script, key, "exec"), {"__name__": "__compile_script__"})
        out[key] = [True, json.loads(buf.getvalue().strip().splitlines()[-1])]
    except BaseException:
        out[key] = [False, traceback.format_exc()[-3000:]]
print(json.dumps(out))
"""


def compile_batch_in_subprocess(scripts: dict[str, str], timeout: int = 900) -> dict[str, list]:
    """Run several `compile_in_subprocess` scripts in ONE fresh Python (one interpreter, torch and triton
    start-up instead of one per script), each in its own namespace.

    Returns: key -> [True, the JSON its last stdout line prints] or [False, its traceback's tail], so that one
    script's failure fails only the test that asserts on it.

    Raises:
        AssertionError: the runner itself failed (the tail of its stderr is the message).
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _BATCH_RUNNER], env=env, check=False, capture_output=True,
                          text=True, timeout=timeout, input=json.dumps(scripts))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compile_with_ptxas(name: str, kernel, cc: int, pointers: dict[str, str], constexprs: dict, warps: int,
                       stages: int, ptx_marker: str | None = None, aligned: tuple[str, ...] = (),
                       unit: tuple[str, ...] = ()) -> dict:
    """Compile `kernel` for sm_<cc> (arguments not in `pointers` / `constexprs` are i32) and run the triton
    wheel's `ptxas -v` on its PTX; call it inside `compile_in_subprocess` (no TRITON_INTERPRET).

    aligned: arguments marked divisible by 16 (tt.divisibility), as a launch specializes 16-byte aligned
    pointers and multiples of 16; without them (and unit strides given as constexprs) loads stay scalar and
    Triton does not pipeline them through cp.async.
    unit: integer arguments fixed to 1 as constexprs, as a launch specializes an argument equal to 1 (unit
    strides): without that the K loop's addressing, and with it registers and spills, differ from the launch's.

    Returns: dict(kernel=name, cc, ptx_target (the PTX .target list), cubin_bytes, shared (bytes per block),
    registers (per thread), spill_bytes, wgmma_serialized (ptxas C7515: it waits for each wgmma before the
    next)), plus ptx_has_marker (bool) when `ptx_marker` is given.
    """
    import re
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas

    sig = {n: pointers.get(n, "i32") for n in kernel.arg_names}
    constexprs = {**constexprs, **{n: 1 for n in unit}}
    sig.update({n: "constexpr" for n in constexprs})
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": warps, "num_stages": stages})
    ptx = k.asm["ptx"]
    target = [line.split()[1] for line in ptx.splitlines() if line.startswith(".target")]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        log = subprocess.run([get_ptxas(cc).path, "-v", f"--gpu-name={target[0]}", f.name, "-o", "/dev/null"],
                             capture_output=True, text=True, check=True).stderr
    out = dict(kernel=name, cc=cc, ptx_target=target, cubin_bytes=len(k.asm["cubin"]), shared=k.metadata.shared,
               registers=int(re.search(r"Used (\d+) registers", log).group(1)),
               spill_bytes=sum(int(b) for b in re.findall(r"(\d+) bytes spill", log)),
               wgmma_serialized="C7515" in log)
    if ptx_marker is not None:
        out["ptx_has_marker"] = ptx_marker in ptx
    return out
