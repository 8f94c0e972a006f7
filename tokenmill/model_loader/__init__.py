"""Find a model's files, read its config, and build it with weights loaded."""

from tokenmill.model_loader.hf_config import load_generation_config, load_hf_config
from tokenmill.model_loader.loader import get_model
from tokenmill.model_loader.source import ModelSource, bundled_gguf_path, resolve_model_source

__all__ = ["ModelSource", "bundled_gguf_path", "get_model", "load_generation_config", "load_hf_config",
           "resolve_model_source"]
