"""A tiny gpt-oss stand-in for end-to-end tests: a harmony tokenizer and a model that plays recorded turns.

The gpt-oss model itself is not in tokenmill yet. `write_model_dir` writes a
model folder that the real server loads with `--load-format dummy`: a
one-layer Llama config whose architecture is `ScriptedHarmonyForCausalLM`,
and a fast tokenizer with the o200k_harmony vocabulary (201,088 ids: the
o200k_base ranks plus harmony's special tokens at their ids), converted
from the o200k_base file tokenmill ships for harmony.

`ScriptedHarmonyForCausalLM` is a real model class in the real engine; its
logits force a recorded harmony turn chosen from the prompt:

    prompt holds a tool result (`<|start|>functions.`)   -> AFTER_TOOL_RESULT
    prompt declares tools (`namespace functions`)         -> TOOL_CALL
    otherwise                                             -> REASONING_THEN_FINAL

After the recorded turn it writes `AFTER_SCRIPT` ("Hello") forever, so an
output that does not end exactly at the turn's `<|return|>` / `<|call|>`
shows that the server failed to stop there.

It keeps one piece of state, the start of the current output (set by each
prefill), so requests must go one at a time and the server must run
without prefix caching (a fully cached prompt would look like a decode).
The server process loads this module through a `sitecustomize.py` on its
PYTHONPATH (`sitecustomize_source`), which registers the architecture.
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ARCH = "ScriptedHarmonyForCausalLM"
VOCAB_SIZE = 201088  # gpt-oss's vocabulary (o200k_harmony)
FIRST_SPECIAL = 199998
AFTER_SCRIPT = 13225  # "Hello": not a stop token


def _recorded() -> dict[str, list[int]]:
    sys.path.insert(0, str(HERE.parent / "entrypoints" / "harmony"))
    try:
        import test_harmony_format as rec
    finally:
        sys.path.pop(0)
    return {"final": rec.REASONING_THEN_FINAL, "call": rec.TOOL_CALL, "after_tool": rec.AFTER_TOOL_RESULT}


def build_tokenizer(out_dir: Path) -> None:
    """Write tokenizer.json / tokenizer_config.json with the o200k_harmony vocabulary into `out_dir`."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from tokenmill.entrypoints.openai.harmony.encoding import O200K_FILE, ensure_o200k_vocab, load_encoding

    ranks: dict[bytes, int] = {}
    for line in (ensure_o200k_vocab() / O200K_FILE).read_bytes().splitlines():
        tok, rank = line.split()
        ranks[base64.b64decode(tok)] = int(rank)

    class _Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return ranks

    enc = load_encoding()
    specials = [enc.decode([i]) for i in range(FIRST_SPECIAL, VOCAB_SIZE)]
    # o200k's split pattern (tiktoken_ext/openai_public.py).
    pattern = "|".join([
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+""",
    ])
    backend = _Converter(vocab_file="o200k_base", pattern=pattern).converted()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                  bos_token="<|startoftext|>")
    tok.add_special_tokens({"additional_special_tokens": [s for s in specials
                                                           if s not in ("<|endoftext|>", "<|startoftext|>")]})
    tok.save_pretrained(str(out_dir))


def write_model_dir(out_dir: Path) -> Path:
    """The model folder (config, generation config, tokenizer); load it with --load-format dummy."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {"architectures": [ARCH], "model_type": "llama", "vocab_size": VOCAB_SIZE, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
              "head_dim": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": True, "torch_dtype": "float32", "bos_token_id": 199998,
              "eos_token_id": 199999, "pad_token_id": 199999, "hidden_act": "silu"}
    (out_dir / "config.json").write_text(json.dumps(config))
    # Unlike gpt-oss's, this generation config stops on <|endoftext|> only: the stops on <|return|> and
    # <|call|> the tests see are the server's harmony stop tokens.
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [199999]}))
    build_tokenizer(out_dir)
    return out_dir


def sitecustomize_source() -> str:
    """A sitecustomize.py that registers the scripted architecture in every server process."""
    return f"import sys\nsys.path.insert(0, {str(HERE)!r})\nimport scripted_harmony\nscripted_harmony.register()\n"


def register() -> None:
    from tokenmill.models.registry import register_model

    sys.modules["tokenmill.models.scripted_harmony_test"] = sys.modules[__name__]
    register_model(ARCH, "scripted_harmony_test", ARCH)


def _llama_base() -> type:
    from tokenmill.models.llama import LlamaForCausalLM

    return LlamaForCausalLM


class ScriptedHarmonyForCausalLM(_llama_base()):
    """A Llama whose logits play back a recorded harmony turn (see the module docstring)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.scripts = _recorded()
        self.script: list[int] = self.scripts["final"]
        self.start = 0  # position of the first output token of the current request

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None) -> torch.Tensor:
        hidden = super().forward(input_ids, positions, intermediate_tensors)
        if input_ids.shape[0] > 1 and int(positions[0]) == 0:  # a prefill (the warm-up runs too, harmlessly)
            from tokenmill.entrypoints.openai.harmony.encoding import load_encoding

            self.start = int(positions[-1]) + 1
            prompt = load_encoding().decode(input_ids.tolist())
            key = "after_tool" if "<|start|>functions." in prompt else \
                "call" if "namespace functions" in prompt else "final"
            self.script = self.scripts[key]
        # Column 0 carries each row's position to compute_logits (the rows it gets are the sampled ones).
        hidden = hidden.clone()
        hidden[:, 0] = positions.to(hidden.dtype)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = torch.full((hidden_states.shape[0], self.config.vocab_size), -1e4, dtype=torch.float32,
                            device=hidden_states.device)
        for row, pos in enumerate(hidden_states[:, 0].round().long().tolist()):
            k = pos + 1 - self.start
            logits[row, self.script[k] if 0 <= k < len(self.script) else AFTER_SCRIPT] = 0.0
        return logits
