"""Tokenizer loading (GGUF conversion cache) and chat-template rendering."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

from tokenmill.model_loader.tokenizer import _gguf_cache_dir, get_tokenizer
from tokenmill.frontend.chat_template import apply_chat_template

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_gguf_tokenizer_is_cached(smollm2_gguf, tokenizer):
    from pathlib import Path

    # The session fixture already converted once: the cache folder exists and loads equal.
    cache = _gguf_cache_dir(Path(smollm2_gguf))
    assert (cache / "tokenizer.json").is_file()
    cfg = SimpleNamespace(skip_tokenizer_init=False, tokenizer=None, model_path=smollm2_gguf, gguf_file=smollm2_gguf,
                          revision=None, trust_remote_code=False)
    tok = get_tokenizer(cfg)
    assert tok.encode("Tiếng Việt 你好") == tokenizer.encode("Tiếng Việt 你好")
    assert tok.chat_template == tokenizer.chat_template
    assert get_tokenizer(SimpleNamespace(**{**vars(cfg), "skip_tokenizer_init": True})) is None


def test_tokenizer_override_folder(tokenizer, tmp_path):
    tokenizer.save_pretrained(str(tmp_path))
    cfg = SimpleNamespace(skip_tokenizer_init=False, tokenizer=str(tmp_path), model_path="/nonexistent.gguf",
                          gguf_file="/nonexistent.gguf", revision=None, trust_remote_code=False)
    assert get_tokenizer(cfg).encode("hello world") == tokenizer.encode("hello world")


def test_chat_template_render(tokenizer):
    text = apply_chat_template(tokenizer, MESSAGES)
    assert text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    no_gen = apply_chat_template(tokenizer, MESSAGES, add_generation_prompt=False)
    assert text.startswith(no_gen) and not no_gen.endswith("assistant\n")


def test_chat_template_override_inline_and_file(tokenizer, tmp_path):
    inline = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    assert apply_chat_template(tokenizer, MESSAGES, chat_template=inline) == \
        "[user] What is the capital of France?\n"
    f = tmp_path / "t.jinja"
    f.write_text(inline)
    assert apply_chat_template(tokenizer, MESSAGES, chat_template=str(f)) == \
        "[user] What is the capital of France?\n"
    with pytest.raises(ValueError, match="neither a readable file"):
        apply_chat_template(tokenizer, MESSAGES, chat_template="/no/such/template.jinja")


def test_no_chat_template_is_a_clear_error(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(tok, MESSAGES)


def test_template_error_is_value_error(tokenizer):
    bad = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="roles must alternate"):
        apply_chat_template(tokenizer, MESSAGES, chat_template=bad)


def test_gguf_conversion_equals_plain_transformers(smollm2_gguf, hf_smollm2, tmp_path, monkeypatch):
    """A cold conversion (config parse through tokenmill's GGUF reader view) == transformers' own, token for token.

    transformers' own is the session's hf_smollm2 tokenizer (`AutoTokenizer.from_pretrained(folder,
    gguf_file=name)`, tests/conftest.py), converted once for every file that uses it."""
    from pathlib import Path

    from tokenmill.model_loader.tokenizer import load_tokenizer

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    ours = load_tokenizer(smollm2_gguf)
    assert _gguf_cache_dir(Path(smollm2_gguf)).is_relative_to(tmp_path)  # really cold
    _, ref = hf_smollm2
    assert type(ours) is type(ref)
    assert ours.backend_tokenizer.to_str() == ref.backend_tokenizer.to_str()
    assert ours.special_tokens_map == ref.special_tokens_map and ours.chat_template == ref.chat_template
    for text in ["Hello, world!", "\u65e5\u672c\u8a9e\u3068\u4e2d\u6587", "emoji \U0001f916\U0001f389\U0001f44d\U0001f3fd",
                 " tabs\tand\nnewlines  "]:
        ids = ours.encode(text)
        assert ids == ref.encode(text)
        assert ours.decode(ids) == ref.decode(ids) == text
    assert apply_chat_template(ours, MESSAGES) == apply_chat_template(ref, MESSAGES)
