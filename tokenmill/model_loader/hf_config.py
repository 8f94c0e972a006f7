"""Read a model's transformers config and generation defaults from its resolved source."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

from tokenmill import envs
from tokenmill.model_loader.source import ModelSource

logger = logging.getLogger(__name__)


def load_hf_config(source: ModelSource, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    """The transformers `PretrainedConfig` of the model.

    From a folder: `AutoConfig.from_pretrained(folder)`. From a GGUF file:
    transformers' own GGUF metadata reader
    (`AutoConfig.from_pretrained(dir, gguf_file=name)`; llama, qwen2, qwen3,
    mistral, gemma3, ... architectures); GGUF metadata has no
    `architectures`, so it is set from the model type's causal-LM class
    (llama -> LlamaForCausalLM). transformers parses every GGUF field,
    tokenizer included; it reads them through tokenmill's fast header reader
    (`gguf_reader_view`: Gemma 3's 262k vocabulary ~1 s instead of ~20 s),
    and the config is cached as JSON under `~/.cache/tokenmill/gguf_configs/`
    (or `$TOKENMILL_CACHE_DIR`), keyed by the file's path, size, mtime and
    the transformers version. `trust_remote_code` is accepted for
    vLLM compatibility but never runs remote code.

    Raises:
        ValueError: transformers cannot read the config.
    """
    from transformers import AutoConfig

    try:
        if source.gguf_file is not None:
            config = _cached_gguf_config(source.gguf_file)
            if config is None:
                from tokenmill.model_loader.gguf_reader_view import gguf_metadata_from_fast_reader

                folder, name = os.path.split(source.gguf_file)
                with gguf_metadata_from_fast_reader(source.gguf_file):
                    config = AutoConfig.from_pretrained(folder, gguf_file=name)
                _store_gguf_config(source.gguf_file, config)
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


def _gguf_config_cache_file(gguf_file: str) -> str:
    import transformers

    st = os.stat(gguf_file)
    key = f"{os.path.abspath(gguf_file)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return os.path.join(envs.cache_dir(), "gguf_configs", hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")


def _cached_gguf_config(gguf_file: str) -> Any | None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = _gguf_config_cache_file(gguf_file)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return CONFIG_MAPPING[data["model_type"]].from_dict(data)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent or unreadable: rebuild from the GGUF


def _store_gguf_config(gguf_file: str, config: Any) -> None:
    path = _gguf_config_cache_file(gguf_file)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(config.to_dict(), f)
        os.replace(tmp, path)  # atomic: a concurrent reader sees all or nothing
    except (OSError, TypeError, ValueError) as e:
        logger.warning("Could not cache the GGUF config in %s: %s", path, e)
