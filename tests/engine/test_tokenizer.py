"""Tokenizer loading (GGUF conversion cache) and chat-template rendering."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

from tokenmill.engine.tokenizer import _gguf_cache_dir, apply_chat_template, get_tokenizer

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
