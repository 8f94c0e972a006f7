"""`core/` stands alone: importing the scheduler loads no front end, no entry points and no torch.

Each check runs in a fresh interpreter so modules other tests imported do not
hide an import.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_FORBIDDEN = ("tokenmill.frontend", "tokenmill.entrypoints", "tokenmill.executor", "tokenmill.worker",
              "torch", "tokenizers", "transformers")


def _loaded_after(statement: str) -> list[str]:
    code = f"import sys, json\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _forbidden(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == f or m.startswith(f + ".") for f in _FORBIDDEN)]


@pytest.mark.parametrize("statement", [
    "import tokenmill.core.scheduler",
    "import tokenmill.core",
    "import tokenmill.engine.messages",
    "import tokenmill",
    "from tokenmill.config import EngineArgs, EngineConfig",
])
def test_core_imports_stand_alone(statement):
    loaded = _loaded_after(statement)
    assert _forbidden(loaded) == []
    assert "tokenmill.config.resolve" not in loaded  # only create_engine_config loads the resolver


def test_public_names_resolve_lazily():
    loaded = _loaded_after("import tokenmill\nassert tokenmill.SamplingParams.__name__ == 'SamplingParams'")
    assert "tokenmill.sampling_params" in loaded and _forbidden(loaded) == []
    loaded = _loaded_after("import tokenmill\nassert tokenmill.LLM.__name__ == 'LLM'")
    assert "tokenmill.entrypoints.llm" in loaded
    with pytest.raises(subprocess.CalledProcessError):
        _loaded_after("import tokenmill\ntokenmill.NoSuchName")


def test_offline_llm_needs_no_serve_extra():
    """`LLM` runs in one process: the serve extra's packages (msgspec for the wire codec, zmq,
    FastAPI, uvicorn, prometheus-client) must not be imported by it."""
    serve_only = ("msgspec", "zmq", "fastapi", "uvicorn", "prometheus_client")
    block = "".join(f"sys.modules[{m!r}] = None\n" for m in serve_only)
    loaded = _loaded_after(f"{block}from tokenmill import LLM\nimport tokenmill.frontend.llm_engine")
    assert "tokenmill.entrypoints.llm" in loaded and "tokenmill.engine.messages" in loaded
