"""Request chat templates: refused without --trust-request-chat-template, text only with it; reserved kwargs refused."""

from __future__ import annotations

import json

import pytest

from tokenmill.entrypoints.openai.chat_template_guard import RESERVED_TEMPLATE_KWARGS, ChatTemplatePolicy

MSGS = [{"role": "user", "content": "Hi"}]
TEXT = "{% for m in messages %}{{ m.content }}{% endfor %}"


@pytest.mark.parametrize("template, kwargs", [
    (TEXT, None), ("/etc/passwd", None), (None, {"chat_template": TEXT}), (None, {"chat_template": "/proc/self/environ"}),
])
def test_without_the_flag_every_request_template_is_refused(template, kwargs):
    with pytest.raises(ValueError, match="--trust-request-chat-template"):
        ChatTemplatePolicy().request_template(template, kwargs)


@pytest.mark.parametrize("template", ["/etc/passwd", "~/.bashrc", "tool_use", "", "plain words", 5])
def test_with_the_flag_paths_names_and_non_text_are_still_refused(template):
    with pytest.raises(ValueError, match="Jinja template text"):
        ChatTemplatePolicy(trust_request_chat_template=True).request_template(None, {"chat_template": template})


def test_with_the_flag_template_text_passes_and_is_split_from_the_variables():
    policy = ChatTemplatePolicy(trust_request_chat_template=True)
    assert policy.request_template(TEXT, {"enable_thinking": False}) == (TEXT, {"enable_thinking": False})
    assert policy.request_template(None, {"chat_template": TEXT, "x": 1}) == (TEXT, {"x": 1})
    with pytest.raises(ValueError, match="differ"):
        policy.request_template(TEXT, {"chat_template": TEXT + " "})


@pytest.mark.parametrize("key", sorted(RESERVED_TEMPLATE_KWARGS))
def test_reserved_kwargs_are_refused(key):
    with pytest.raises(ValueError, match=key):
        ChatTemplatePolicy(trust_request_chat_template=True).request_template(None, {key: True})


def test_no_template_fields_mean_no_template():
    assert ChatTemplatePolicy().request_template(None, None) == (None, {})


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": MSGS, "chat_template": TEXT}),
    ("/v1/chat/completions", {"messages": MSGS, "chat_template_kwargs": {"chat_template": "/etc/passwd"}}),
    ("/v1/chat/completions", {"messages": MSGS, "chat_template_kwargs": {"messages": []}}),
    ("/v1/chat/completions", {"messages": MSGS, "chat_template_kwargs": {"add_generation_prompt": 1}}),
    ("/v1/chat/completions", {"messages": MSGS, "chat_template_kwargs": {"sanitize_control_tokens": False}}),
    ("/tokenize", {"messages": MSGS, "chat_template": TEXT}),
    ("/tokenize", {"messages": MSGS, "chat_template_kwargs": {"chat_template": "/etc/passwd"}}),
    ("/tokenize", {"messages": MSGS, "chat_template_kwargs": {"tools": []}}),
])
def test_the_http_routes_answer_400(call, path, body):
    status, raw = call("POST", path, body)
    assert status == 400, raw
    assert json.loads(raw)["error"]["type"] == "invalid_request_error"

