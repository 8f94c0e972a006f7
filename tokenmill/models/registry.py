"""Architecture name (HF `config.architectures[i]`) -> model class, imported lazily.

Add a model family by one line in `_MODELS`: the module under
`tokenmill.models` and the class name. Modules are imported only when their
architecture is requested, so one broken model file cannot break start-up
for the others.
"""

from __future__ import annotations

import importlib

from torch import nn

# architecture -> (module under tokenmill.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
}


def get_supported_archs() -> list[str]:
    """Every registered architecture name, sorted."""
    return sorted(_MODELS)


def register_model(architecture: str, module: str, class_name: str) -> None:
    """Register (or override) `architecture` -> `tokenmill.models.<module>.<class_name>`."""
    _MODELS[architecture] = (module, class_name)


def resolve_model_cls(architectures: list[str] | None) -> tuple[type[nn.Module], str]:
    """The class of the first supported architecture in `architectures`.

    Returns:
        (model class, architecture name).

    Raises:
        ValueError: none of `architectures` is supported; the message lists
            the supported ones.
    """
    for arch in architectures or []:
        if arch in _MODELS:
            module_name, class_name = _MODELS[arch]
            module = importlib.import_module(f"tokenmill.models.{module_name}")
            return getattr(module, class_name), arch
    raise ValueError(
        f"Model architecture(s) {list(architectures or [])} are not supported by tokenmill. "
        f"Supported architectures: {', '.join(get_supported_archs())}."
    )
