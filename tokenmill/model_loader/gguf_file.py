"""A fast GGUF header reader: scalar metadata and tensor infos, tensor data as memory-mapped arrays.

`gguf.GGUFReader` builds a NumPy view for every part of every metadata
field; for a model with a 49k-token vocabulary and its merges that is
several seconds (tens under load) spent on tokenizer fields the weight
loader never reads. This reader walks the same header with `struct` over a
memory map, skips arrays, and keeps only scalar fields; with `fields=True`
it also keeps every key-value pair as stored, arrays read whole (a
262k-token vocabulary: ~0.3 s, against ~15 s for GGUFReader's per-element
views), for `gguf_reader_view`.

Layout (GGUF v2/v3, little-endian; llama.cpp's docs/gguf.md):

    | "GGUF" | version u32 | n_tensors u64 | n_kv u64 |
    | n_kv x (key str, value_type u32, value) |
    | n_tensors x (name str, n_dims u32, dims u64[n_dims], ggml_type u32, offset u64) |
    | padding to `general.alignment` (32) | tensor data (offsets relative to here) |

    str = (len u64, utf-8 bytes); array = (item_type u32, count u64, items)
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

# GGUF value type -> struct format of a scalar; 8 = string, 9 = array.
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # PyTorch order (GGUF's dims reversed)
    ggml_type: int  # gguf.GGMLQuantizationType value
    offset: int  # absolute byte offset of the data in the file


@dataclass(frozen=True, slots=True)
class GGUFField:
    """One metadata key-value pair as the file stores it (`read_gguf(path, fields=True)`)."""

    key: str
    types: tuple[int, ...]  # (value type,) or (9, item type) for an array: GGUF value type numbers
    value: Any  # int, float, bool, or bytes (strings undecoded); a list of those for an array


@dataclass(slots=True)
class GGUFFile:
    """Scalar metadata and tensor infos of a GGUF file; `tensor_data` maps a tensor's bytes."""

    path: str
    metadata: dict[str, Any]  # scalar fields only (strings, numbers, bools); arrays skipped
    tensors: list[GGUFTensorInfo]
    _buf: Any = None
    version: int = 3  # GGUF format version
    fields: list[GGUFField] | None = None  # every key-value pair in file order; only with fields=True

    def tensor_data(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's raw data as `gguf.quants.dequantize` takes it (as GGUFReader's `tensor.data`).

        F32/F16/F64/I8..I64 tensors: typed arrays of `info.shape`; quantized
        (and BF16) ones: uint8 `[..., bytes per row]`. Read-only views of the file.
        """
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        qtype = GGMLQuantizationType(info.ggml_type)
        n = int(np.prod(info.shape)) if info.shape else 1
        typed = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}
        if qtype.name in typed:
            dtype = np.dtype(typed[qtype.name])
            return np.frombuffer(self._buf, dtype=dtype, count=n, offset=info.offset).reshape(info.shape)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = n * type_size // block_size
        raw = np.frombuffer(self._buf, dtype=np.uint8, count=n_bytes, offset=info.offset)
        return raw.reshape(quant_shape_to_byte_shape(info.shape, qtype))


def read_gguf(path: str, fields: bool = False) -> GGUFFile:
    """Parse `path`'s header; tensor data stays on disk (memory-mapped).

    `fields=True` also reads every metadata value, arrays included, into
    `GGUFFile.fields` (strings as raw bytes).

    Raises:
        ValueError: not a GGUF file, an unsupported version (v1), or (with
            `fields=True`) an array of arrays, which no GGUF writer emits.
    """
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    r = _Cursor(buf)
    if buf[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (bad magic).")
    r.pos = 4
    version = r.scalar("<I")
    if version < 2:
        raise ValueError(f"{path} is GGUF version {version}; only versions 2 and 3 are supported.")
    n_tensors, n_kv = r.scalar("<Q"), r.scalar("<Q")
    metadata: dict[str, Any] = {}
    kept: list[GGUFField] | None = [] if fields else None
    for _ in range(n_kv):
        key = r.string()
        vtype = r.scalar("<I")
        if kept is not None:
            field = r.field(key, vtype)
            kept.append(field)
            value = field.value.decode("utf-8", errors="replace") if vtype == _STRING else field.value
            if vtype != _ARRAY:
                metadata[key] = value
            continue
        value = r.value(vtype)
        if value is not _SKIPPED:
            metadata[key] = value
    raw_infos = []
    for _ in range(n_tensors):
        name = r.string()
        dims = [r.scalar("<Q") for _ in range(r.scalar("<I"))]
        raw_infos.append((name, tuple(reversed(dims)), r.scalar("<I"), r.scalar("<Q")))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-r.pos // alignment) * alignment
    tensors = [GGUFTensorInfo(name, shape, t, data_start + off) for name, shape, t, off in raw_infos]
    return GGUFFile(path=path, metadata=metadata, tensors=tensors, _buf=buf, version=version, fields=kept)


_SKIPPED = object()
_U64 = struct.Struct("<Q")


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        return self.raw_string().decode("utf-8", errors="replace")

    def raw_string(self) -> bytes:
        n = self.scalar("<Q")
        s = self.buf[self.pos:self.pos + n]
        self.pos += n
        return s

    def field(self, key: str, vtype: int) -> GGUFField:
        """The value of type `vtype` at the cursor, read whole (arrays too)."""
        if vtype == _STRING:
            return GGUFField(key, (vtype,), self.raw_string())
        if vtype != _ARRAY:
            fmt = _SCALAR_FMT.get(vtype)
            if fmt is None:
                raise ValueError(f"Unknown GGUF value type {vtype} at byte {self.pos}.")
            return GGUFField(key, (vtype,), self.scalar(fmt))
        item_type, count = self.scalar("<I"), self.scalar("<Q")
        if item_type == _STRING:
            return GGUFField(key, (vtype, item_type), self._string_array(count))
        fmt = _SCALAR_FMT.get(item_type)
        if fmt is None:
            raise ValueError(f"GGUF field {key!r} is an array of value type {item_type}, which is not supported.")
        values = list(struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.pos))  # one call for the whole array
        self.pos += struct.calcsize(fmt) * count
        return GGUFField(key, (vtype, item_type), values)

    def _string_array(self, count: int) -> list[bytes]:
        # Locals: this loop runs once per vocabulary entry (262k for Gemma 3, ~0.2 s).
        buf, pos, unpack = self.buf, self.pos, _U64.unpack_from
        out = []
        for _ in range(count):
            (n,) = unpack(buf, pos)
            out.append(buf[pos + 8:pos + 8 + n])
            pos += 8 + n
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            self._skip_array(item_type, count)
            return _SKIPPED
        fmt = _SCALAR_FMT.get(vtype)
        if fmt is None:
            raise ValueError(f"Unknown GGUF value type {vtype} at byte {self.pos}.")
        return self.scalar(fmt)

    def _skip_array(self, item_type: int, count: int) -> None:
        if item_type in _SCALAR_FMT:
            self.pos += struct.calcsize(_SCALAR_FMT[item_type]) * count
        elif item_type == _STRING:
            for _ in range(count):  # 49k tokens + merges: ~0.1 s
                (n,) = struct.unpack_from("<Q", self.buf, self.pos)
                self.pos += 8 + n
        else:
            for _ in range(count):
                self.value(item_type)
