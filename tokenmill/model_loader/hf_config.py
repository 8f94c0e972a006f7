"""Read a model's transformers config and generation defaults from its resolved source."""

from __future__ import annotations

import json
import os
from typing import Any

from tokenmill.model_loader.source import ModelSource


def load_hf_config(source: ModelSource, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    """The transformers `PretrainedConfig` of the model.

    From a folder: `AutoConfig.from_pretrained(folder)`. From a GGUF file:
    transformers' own GGUF metadata reader
    (`AutoConfig.from_pretrained(dir, gguf_file=name)`; llama, qwen2, qwen3,
    mistral, gemma3, ... architectures); GGUF metadata has no
    `architectures`, so it is set from the model type's causal-LM class
    (llama -> LlamaForCausalLM). `trust_remote_code` is accepted for
    vLLM compatibility but never runs remote code.

    Raises:
        ValueError: transformers cannot read the config.
    """
    from transformers import AutoConfig

    try:
        if source.gguf_file is not None:
            folder, name = os.path.split(source.gguf_file)
            config = AutoConfig.from_pretrained(folder, gguf_file=name)
        else:
            config = AutoConfig.from_pretrained(source.path)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"Could not read the model config of {source.weights_path}: {e}") from e
    if not getattr(config, "architectures", None):
        # GGUF metadata (and some old configs) name only the model type.
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        config.architectures = [arch] if arch else []
    return config


def load_generation_config(source: ModelSource) -> dict[str, Any]:
    """The folder's generation_config.json as a dict ({} when absent or unreadable)."""
    path = os.path.join(source.path, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}
