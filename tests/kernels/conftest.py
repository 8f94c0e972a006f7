"""Kernel tests run on CPU through the Triton interpreter unless a GPU is present.

TRITON_INTERPRET must be set before `triton` is first imported (triton.jit
decides at decoration time, including for triton.language's own helpers), so
this conftest sets it before anything imports the kernels.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_interpreter_scalar_index() -> None:
    """Work around Triton 3.6's interpreter under NumPy >= 2.3.

    The interpreter keeps scalars as 1-element arrays and converts loop bounds
    with `int(array)`, which NumPy 2.3+ rejects for 1-d arrays ("only
    0-dimensional arrays can be converted to Python scalars"); a `range()`
    whose bounds were loaded from memory then fails. Convert the one element.
    Compiled (GPU) kernels are unaffected.
    """
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_scalar_index()


@pytest.fixture(scope="session")
def compiled_kernels(request):
    """compiled_kernels(__name__) -> the JSON list printed by that test module's SCRIPT, compiled for explicit GPU
    targets (compile_helpers.compile_with_ptxas) without a GPU.

    The SCRIPTs of every selected test module that uses this fixture run once, together, in one subprocess
    (compile_helpers.compile_batch_in_subprocess): one Python, torch and triton start-up for all of them. A
    failed script fails only the tests of its module, with its traceback.
    """
    from compile_helpers import compile_batch_in_subprocess
    from optional_deps import require

    require("triton")
    scripts = {item.module.__name__: item.module.SCRIPT for item in request.session.items
               if "compiled_kernels" in getattr(item, "fixturenames", ())}
    results = compile_batch_in_subprocess(scripts)

    def get(module_name: str) -> list[dict]:
        ok, value = results[module_name]
        assert ok, value
        return value

    return get
