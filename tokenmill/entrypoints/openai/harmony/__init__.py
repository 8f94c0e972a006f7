"""The harmony chat format of gpt-oss (openai-harmony): encoding, rendering, output parsing, chat hook.

Modules: encoding (the encoding and its offline o200k_base vocabulary),
render (chat messages -> prompt ids), parse (output ids -> reasoning,
content, tool calls), chat (the /v1/chat/completions hook), tool_parser
and reasoning_parser (the `openai` / `openai_gptoss` parser names).
"""
