"""Tokenizer loading (folders, hub ids, GGUF files); both processes use it (the front end to tokenize,
the engine core to compile grammars). Chat templates: `frontend/chat_template.py`.

A GGUF file carries its tokenizer inside the file; transformers rebuilds a
fast tokenizer from it (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`;
the config parse inside it goes through tokenmill's fast header reader, see
`model_loader/gguf_reader_view.py`), which takes a few seconds (Gemma 3's
262k vocabulary: ~6 s of CPU). The rebuilt tokenizer is saved once under
`~/.cache/tokenmill/tokenizers/<key>` (key = sha256 of the file's path,
size and mtime; env `TOKENMILL_CACHE_DIR` moves the root) and loaded from
there afterwards in well under a second.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenmill import envs

if TYPE_CHECKING:
    from tokenmill.config.configs import ModelConfig


logger = logging.getLogger(__name__)

# Files save_pretrained writes that prove a cached conversion is complete.
_CACHE_MARKER = "tokenizer.json"


def _cache_root() -> Path:
    return envs.cache_dir() / "tokenizers"


def _gguf_cache_dir(gguf_path: Path) -> Path:
    st = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return _cache_root() / hashlib.sha256(key.encode()).hexdigest()[:32]


def load_tokenizer(path: str, gguf_file: str | None = None, revision: str | None = None,
                   trust_remote_code: bool = False) -> Any:
    """Load a fast (tokenizers-backed) tokenizer.

    Args:
        path: a folder, a hub repo id, or a `.gguf` file.
        gguf_file: file name inside the folder `path` when the tokenizer comes
            from a GGUF file.
        revision: hub revision.
        trust_remote_code: passed to transformers.

    Returns:
        A transformers tokenizer whose `backend_tokenizer` is a `tokenizers.Tokenizer`.

    Raises:
        ValueError: the tokenizer cannot be loaded from `path`.
    """
    from transformers import AutoTokenizer

    p = Path(path)
    if gguf_file is None and p.suffix == ".gguf" and p.is_file():
        p, gguf_file = p.parent, p.name
    if gguf_file is not None:
        gguf_path = Path(p) / gguf_file
        cache_dir = _gguf_cache_dir(gguf_path)
        if (cache_dir / _CACHE_MARKER).is_file():
            return AutoTokenizer.from_pretrained(str(cache_dir))
        logger.info("Converting the tokenizer in %s (done once; cached in %s).", gguf_path, cache_dir)
        from tokenmill.model_loader.gguf_reader_view import gguf_metadata_from_fast_reader

        with gguf_metadata_from_fast_reader(str(gguf_path)):  # its config parse: ~1 s instead of ~20 s (Gemma 3)
            tok = AutoTokenizer.from_pretrained(str(p), gguf_file=gguf_file, trust_remote_code=trust_remote_code)
        # Write to a private folder, then rename: a concurrent loader never sees half a cache.
        tmp = cache_dir.with_name(f"{cache_dir.name}.tmp{os.getpid()}")
        try:
            tok.save_pretrained(str(tmp))
            os.replace(tmp, cache_dir)
        except OSError as e:  # a read-only home (or a racing writer) must not stop the engine
            logger.warning("Could not cache the converted tokenizer in %s: %s", cache_dir, e)
            shutil.rmtree(tmp, ignore_errors=True)
        return tok
    try:
        return AutoTokenizer.from_pretrained(str(path), revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(f"Cannot load a tokenizer from {path!r}: {e}. Pass --tokenizer with a tokenizer folder "
                         "or hub id.") from e


def get_tokenizer(model_config: ModelConfig) -> Any | None:
    """The tokenizer for `model_config` (a `ModelConfig`), or None with skip_tokenizer_init.

    `model_config.tokenizer` (the `--tokenizer` override, or the model's path)
    wins; when it is the GGUF file that holds the weights (or the folder that
    holds it and has no tokenizer files), the GGUF's embedded tokenizer is used.
    """
    if model_config.skip_tokenizer_init:
        return None
    path = model_config.tokenizer or model_config.model_path
    gguf_file = None
    p = Path(path)
    if p.suffix == ".gguf":
        p, gguf_file = p.parent, p.name
    elif model_config.gguf_file and p.is_dir() and not (p / "tokenizer.json").exists() \
            and not (p / "tokenizer_config.json").exists():
        gguf_file = Path(model_config.gguf_file).name
    return load_tokenizer(str(p), gguf_file=gguf_file, revision=model_config.revision,
                          trust_remote_code=model_config.trust_remote_code)
