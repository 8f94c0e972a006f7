"""tokenmill: an LLM inference and serving engine (vLLM-compatible API).

The public names below are resolved on first use (module `__getattr__`), so
`import tokenmill.core` or `import tokenmill.engine.messages` loads no
front end, tokenizer or torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.config import EngineArgs
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.outputs import CompletionOutput, RequestOutput
    from tokenmill.sampling_params import SamplingParams

# public name -> module that defines it
_PUBLIC: dict[str, str] = {
    "LLM": "tokenmill.entrypoints.llm",
    "SamplingParams": "tokenmill.sampling_params",
    "RequestOutput": "tokenmill.outputs",
    "CompletionOutput": "tokenmill.outputs",
    "EngineArgs": "tokenmill.config",
}

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineArgs"]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
