"""transformers' own GGUF reader, the reference loader of the model tests, without its repeated parsing."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within the block, transformers' GGUF reader parses each file once and builds each tensor-name map once.

    transformers' `load_gguf_checkpoint` opens a fresh gguf.GGUFReader per call
    (the tokenizer, the config and the weights are three calls; each parses all
    metadata in Python, seconds for a 49k-token vocabulary) and rebuilds
    gguf.get_tensor_name_map per parameter (~400 times). Both are read-only
    results of their arguments, so sharing them changes no value that
    transformers computes; it only drops the repeated parsing.
    """
    import gguf

    readers: dict[tuple, object] = {}
    original_reader, original_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if mode != "r":
            return original_reader(path, mode)
        if key not in readers:
            readers[key] = original_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(original_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_map
