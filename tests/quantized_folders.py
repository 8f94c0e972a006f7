"""Model folders for `load_format="dummy"` runs of quantized models (a config.json, no weights)."""

from __future__ import annotations

import json
import os


def dummy_quantized_folder(folder, config, quantization_config: dict) -> str:
    """Save the transformers `config` into `folder` with `quantization_config` added to its config.json.

    Returns the folder as a str (what EngineArgs / LLM take as `model`).
    """
    config.save_pretrained(folder)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        raw = json.load(f)
    raw["quantization_config"] = quantization_config
    with open(path, "w") as f:
        json.dump(raw, f)
    return str(folder)
