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
    with this checkout first on PYTHONPATH; returns the JSON list its last stdout line prints.

    Raises:
        AssertionError: the script failed (the tail of its stderr is the message).
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", script], env=env, check=False, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
