"""transformers' GGUF metadata parse, fed by tokenmill's fast header reader instead of `gguf.GGUFReader`.

`AutoConfig.from_pretrained(dir, gguf_file=)` and
`AutoTokenizer.from_pretrained(dir, gguf_file=)` both build the model's
config with transformers' `load_gguf_checkpoint(path, return_tensors=False)`
(for every architecture its newer reader does not cover: llama, qwen2/3,
gemma3, ...). That constructs `gguf.GGUFReader`, which makes a NumPy view per
element of every array: for Gemma 3's 262k-token vocabulary (tokens, scores,
token types) about 15 s of CPU, 20-25 s with the parse that follows, twice
per cold load.

`gguf_metadata_from_fast_reader(path)` is a context manager: inside it, in
the calling thread, `gguf.GGUFReader(path)` returns a `GGUFReaderView` of
`read_gguf(path, fields=True)` (one `struct` walk, arrays read whole), built
once per context. The view has what `load_gguf_checkpoint` reads of a
reader, with the same values, so transformers' own code still turns the
metadata into the config (tokenizer arrays included: ~1 s in all for
Gemma 3):

    reader.fields[key].parts[i] for i in .data   one value each, as _gguf_parse_value takes it
    reader.fields[key].types                      [value type] or [9, item type]
    reader.fields[key].parts[0]                   the key's length (GGUFReader's first part)
    reader.tensors[j].name                        tensor names, file order

Other threads and other paths get the real GGUFReader. A view has no tensor
data: loading weights through transformers inside the context is not supported.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenmill.model_loader.gguf_file import GGUFFile, GGUFTensorInfo, read_gguf

_ARRAY, _STRING = 9, 8
_UINT32, _UINT64 = 4, 10
# Held for a whole context: each one swaps the gguf module's GGUFReader attribute.
_swap_lock = threading.RLock()


@dataclass(slots=True)
class ViewField:
    """One metadata field in the shape of `gguf.ReaderField` (the parts transformers reads).

    `parts`: `[key length (uint64 array), key bytes (uint8 array), value type
    (uint32 array), value parts...]`; a value part is `(number,)` or the raw
    bytes of a string. GGUFReader's per-string length parts (and an array's
    item type and count) are left out: nothing reads them.
    """

    name: str
    parts: list[Any]
    data: list[int]  # indices into parts of the values (one per array element)
    types: list[int]  # [value type] or [9, item type]


class GGUFReaderView:
    """`fields` and `tensors` of one GGUF file, as `load_gguf_checkpoint` reads them from a GGUFReader.

    Raises:
        ValueError: the file cannot be parsed (see `read_gguf`).
    """

    def __init__(self, gf: GGUFFile) -> None:
        assert gf.fields is not None, "read_gguf(path, fields=True) keeps the fields"
        self.tensors: list[GGUFTensorInfo] = gf.tensors
        self.fields: dict[str, ViewField] = {}
        # GGUFReader's three header pseudo-fields come first (transformers maps them to "ignore").
        for name, value, vtype in (("GGUF.version", gf.version, _UINT32),
                                   ("GGUF.tensor_count", len(gf.tensors), _UINT64),
                                   ("GGUF.kv_count", len(gf.fields), _UINT64)):
            self.fields[name] = ViewField(name, [(value,)], [0], [vtype])
        for f in gf.fields:
            key = f.key.encode("utf-8")
            header = [np.array([len(key)], np.uint64), np.frombuffer(key, np.uint8), np.array([f.types[0]], np.uint32)]
            if f.types[0] != _ARRAY:
                values = [f.value if f.types[0] == _STRING else (f.value,)]
            elif f.types[1] == _STRING:
                values = f.value  # bytes per element, parsed as a string each
            else:
                values = list(zip(f.value))  # 1-tuples, made in C: [(v0,), (v1,), ...]
            n = len(header)
            self.fields[f.key] = ViewField(f.key, header + values, list(range(n, n + len(values))), list(f.types))


@contextmanager
def gguf_metadata_from_fast_reader(path: str) -> Iterator[None]:
    """While open, `gguf.GGUFReader(path)` called from this thread returns a `GGUFReaderView` of `path`.

    Wrap `AutoConfig.from_pretrained(dir, gguf_file=)` or
    `AutoTokenizer.from_pretrained(dir, gguf_file=)` in it; their results do
    not change (same fields, same values), only the time to read the file.
    One context at a time per process: another thread's context waits
    (nesting in one thread is fine), so the swaps of `gguf.GGUFReader`
    always undo in reverse order.
    """
    import gguf

    with _swap_lock:
        real = gguf.GGUFReader
        gguf.GGUFReader = _ViewingReader(real, os.path.realpath(path), threading.get_ident())
        try:
            yield
        finally:
            gguf.GGUFReader = real


class _ViewingReader:
    """Stands in for `gguf.GGUFReader`: the view for one path in one thread, the real reader for the rest."""

    def __init__(self, real: Any, path: str, thread: int) -> None:
        self.real = real  # what gguf.GGUFReader was before (the class, or an enclosing _ViewingReader)
        self.path = path
        self.thread = thread
        self.view: GGUFReaderView | None = None

    def __call__(self, path: Any, mode: str = "r") -> Any:
        if threading.get_ident() != self.thread or mode != "r" or os.path.realpath(path) != self.path:
            return self.real(path, mode)
        if self.view is None:
            self.view = GGUFReaderView(read_gguf(self.path, fields=True))
        return self.view
