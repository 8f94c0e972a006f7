"""POST /tokenize and POST /detokenize, with vLLM's request and response shapes.

    /tokenize   {"prompt": str, "add_special_tokens": true}               (completion style)
             or {"messages": [...], "add_generation_prompt": true, ...}   (chat style, template applied)
             -> {"count": int, "max_model_len": int, "tokens": [int], "token_strs": [str] | null}
    /detokenize {"tokens": [int]} -> {"prompt": str}

Both accept `model` (checked like the generation endpoints: 404 when unknown).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from tokenmill.entrypoints.openai.chat_template_guard import ChatTemplatePolicy
from tokenmill.entrypoints.openai.protocol import ChatMessage, OpenAIModel
from tokenmill.entrypoints.openai.serving_engine import OpenAIServing


class TokenizeRequest(OpenAIModel):
    """POST /tokenize body: exactly one of `prompt` or `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int] = Field(max_length=2**20)


class DetokenizeResponse(OpenAIModel):
    prompt: str


class OpenAIServingTokenization(OpenAIServing):
    """Handler for /tokenize and /detokenize (no engine request is made)."""

    # The server's chat-template rules (api_server sets it from its flags).
    template_policy = ChatTemplatePolicy()

    def _tokenizer(self) -> Any:
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("This server runs without a tokenizer (--skip-tokenizer-init); it cannot tokenize.")
        return tok

    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        """Token ids of a prompt or of rendered chat messages.

        Raises:
            ValueError: neither or both of prompt/messages, no tokenizer, or a template error (400).
            ModelNotFoundError: unknown model (404).
        """
        from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest

        self.check_model(req.model)
        tok = self._tokenizer()
        if (req.prompt is None) == (req.messages is None):
            raise ValueError("Give exactly one of `prompt` (text) or `messages` (chat) to tokenize.")
        if req.messages is not None:
            chat = ChatCompletionRequest(messages=req.messages)
            template, kwargs = self.template_policy.request_template(req.chat_template, req.chat_template_kwargs)
            if req.continue_final_message:
                kwargs["continue_final_message"] = True
            ids = self.template_policy.render(
                self.engine, chat.message_dicts(), chat_template=template,
                add_generation_prompt=req.add_generation_prompt and not req.continue_final_message, **kwargs)
        else:
            ids = list(tok.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs and hasattr(tok, "convert_ids_to_tokens") \
            else None
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids, token_strs=strs)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        """Text of token ids.

        Raises:
            ValueError: a token id outside the vocabulary, or no tokenizer (400).
            ModelNotFoundError: unknown model (404).
        """
        self.check_model(req.model)
        tok = self._tokenizer()
        self.check_token_ids(req.tokens, "tokens")
        return DetokenizeResponse(prompt=tok.decode(req.tokens))
