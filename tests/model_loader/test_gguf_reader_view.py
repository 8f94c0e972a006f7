"""read_gguf(fields=True) and the GGUFReader view: transformers' GGUF metadata parse must not change."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from optional_deps import require

gguf = require("gguf")

# Every value type, the three tokenizer arrays a vocabulary is made of (non-ASCII tokens included) and merges.
_TOKENS = ["<unk>", "<s>", "</s>", "a", "bc", "\u00e9t\u00e9", "\u65e5\u672c", "\U0001f916", "\u2581the"] * 7


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    from gguf import GGUFValueType as T

    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_string("general.name", "tiny \u00e9")
    writer.add_uint32("llama.context_length", 128)
    writer.add_uint32("llama.embedding_length", 16)
    writer.add_uint32("llama.block_count", 2)
    writer.add_uint64("llama.feed_forward_length", 32)
    writer.add_uint32("llama.attention.head_count", 2)
    writer.add_uint32("llama.attention.head_count_kv", 1)
    writer.add_float32("llama.rope.freq_base", 10000.5)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float64("tiny.f64", math.pi)
    writer.add_int8("tiny.i8", -3)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", _TOKENS)
    writer.add_array("tokenizer.ggml.scores", [float(-i) / 3 for i in range(len(_TOKENS))])
    writer.add_array("tokenizer.ggml.token_type", [1 + i % 3 for i in range(len(_TOKENS))])
    writer.add_array("tokenizer.ggml.merges", ["a b", "b c", "\u00e9 t"])
    writer.add_key_value("tiny.u64s", [1, 2**40], T.ARRAY, T.UINT64)
    writer.add_key_value("tiny.bools", [True, False, True], T.ARRAY, T.BOOL)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.add_string("tokenizer.chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    writer.add_tensor("token_embd.weight", np.zeros((len(_TOKENS), 16), np.float32))
    writer.add_tensor("output_norm.weight", np.ones(16, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_read_gguf_fields_match_gguf_reader(tiny_gguf):
    from tokenmill.model_loader.gguf_file import read_gguf

    ours, ref = read_gguf(tiny_gguf, fields=True), gguf.GGUFReader(tiny_gguf)
    ref_fields = [f for name, f in ref.fields.items() if not name.startswith("GGUF.")]
    assert [f.key for f in ours.fields] == [f.name for f in ref_fields]
    for mine, theirs in zip(ours.fields, ref_fields, strict=True):
        assert mine.types == tuple(int(t) for t in theirs.types), mine.key
        expected = theirs.contents()
        got = mine.value
        if mine.types[-1] == 8:  # strings: raw bytes here, decoded by contents()
            got = [b.decode() for b in got] if isinstance(got, list) else got.decode()
        assert got == expected, mine.key
    assert ours.version == 3
    # The scalar view is unchanged by fields=True: arrays stay out of it.
    assert ours.metadata == read_gguf(tiny_gguf).metadata
    assert "tokenizer.ggml.tokens" not in ours.metadata and ours.metadata["general.name"] == "tiny \u00e9"


def _same(a, b, where: str = "") -> None:
    """Equal values of equal types, recursively (1 == 1.0 == True would hide a changed parse)."""
    assert type(a) is type(b), f"{where}: {type(a)} vs {type(b)}"
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def test_load_gguf_checkpoint_parse_unchanged_by_the_view(tiny_gguf):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from tokenmill.model_loader.gguf_reader_view import GGUFReaderView, gguf_metadata_from_fast_reader

    ref = load_gguf_checkpoint(tiny_gguf, return_tensors=False)
    with gguf_metadata_from_fast_reader(tiny_gguf):
        assert isinstance(gguf.GGUFReader(tiny_gguf), GGUFReaderView)
        ours = load_gguf_checkpoint(tiny_gguf, return_tensors=False)
    _same(ours, ref)
    assert ours["config"]["model_type"] == "llama" and ours["config"]["tie_word_embeddings"] is True
    assert ours["tokenizer"]["tokens"] == _TOKENS and len(ours["tokenizer"]["merges"]) == 3


def test_view_only_for_its_path_and_thread_and_restored(tiny_gguf, tmp_path):
    from tokenmill.model_loader.gguf_reader_view import GGUFReaderView, gguf_metadata_from_fast_reader

    real = gguf.GGUFReader
    other = str(tmp_path / "copy.gguf")
    with open(tiny_gguf, "rb") as src, open(other, "wb") as dst:
        dst.write(src.read())
    seen = []
    with pytest.raises(RuntimeError), gguf_metadata_from_fast_reader(tiny_gguf):
        view = gguf.GGUFReader(tiny_gguf)
        assert gguf.GGUFReader(tiny_gguf) is view  # parsed once per context
        assert isinstance(gguf.GGUFReader(other), real)  # another file: the real reader
        t = threading.Thread(target=lambda: seen.append(gguf.GGUFReader(tiny_gguf)))
        t.start()
        t.join()
        raise RuntimeError("leaving the context by an exception still restores the reader")
    assert isinstance(view, GGUFReaderView) and isinstance(seen[0], real)  # another thread: the real reader
    assert gguf.GGUFReader is real
