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


def _patch_interpreter_device_calls() -> None:
    """Skip the interpreter's repeated patching of triton.language inside a launch (Triton 3.6; speed only).

    A launch (GridExecutor.__call__) patches triton.language's functions to
    interpreted ones and restores them when it ends; every call of a
    @triton.jit helper from the kernel (InterpretedFunction.__call__) patches
    the same modules again, once per program instance and call site, and never
    restores: redundant work, ~12% of the kernel tests' interpreter time. Inside
    a launch, a helper whose triton.language modules the launch has already
    patched gets an empty patch scope; anything else goes through Triton's own
    `_patch_lang`. Nothing changes if Triton's internals differ from these.
    """
    import inspect
    import threading

    import triton.language as tl
    import triton.runtime.interpreter as interp

    if not (hasattr(interp, "_patch_lang") and hasattr(interp, "GridExecutor") and hasattr(interp, "_LangPatchScope")):
        return
    original_patch, original_launch = interp._patch_lang, interp.GridExecutor.__call__
    state = threading.local()  # .patched: ids of the lang modules the launch in progress patched (None: no launch)

    def patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        patched = getattr(state, "patched", None)
        if patched and langs <= patched:
            return interp._LangPatchScope()  # nothing patched, nothing to restore
        scope = original_patch(fn)
        if patched is not None:
            patched |= langs
        return scope

    def launch(self, *args, **kwargs):
        state.patched = set()
        try:
            return original_launch(self, *args, **kwargs)
        finally:
            state.patched = None

    interp._patch_lang = patch_lang
    interp.GridExecutor.__call__ = launch


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_scalar_index()
    _patch_interpreter_device_calls()


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
