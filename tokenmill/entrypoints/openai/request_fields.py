"""Request-body fields tokenmill does not declare: refused with a sentence, ignored with a log line, or unknown.

Every field of a /v1/completions or /v1/chat/completions body is one of:

- declared on the request model (protocol.py) and honoured;
- in `UNSUPPORTED`: a vLLM or OpenAI field tokenmill cannot honour. A
  non-neutral value is a 400 naming the field; the neutral value (what a
  client sends when it does not use the feature, e.g. `use_beam_search:
  false`) is accepted, since it asks for nothing;
- in `IGNORED`: a field that changes nothing here; accepted, and logged once
  per field name with the reason;
- anything else: unknown, accepted and logged once per field name (vLLM
  warns the same way), so a typo is visible in the server log.
"""

from __future__ import annotations

import logging
from typing import Any

from tokenmill.sampling_params import InvalidFieldError

logger = logging.getLogger(__name__)

# field -> (neutral values, why it cannot be honoured)
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "beam search is not implemented in tokenmill"),
    "length_penalty": ((1.0, 1), "it only applies to beam search, which tokenmill does not implement"),
    "early_stopping": ((False,), "it only applies to beam search, which tokenmill does not implement"),
    "kv_transfer_params": (({},), "disaggregated prefill (KV transfer) is not implemented in tokenmill"),
    "vllm_xargs": (({},), "custom logits processors (vllm_xargs) are not supported in tokenmill"),
    "logits_processors": (([],), "custom logits processors are not supported in tokenmill"),
    "prompt_embeds": ((), "prompt embeddings are not supported; send text or token ids"),
    "mm_processor_kwargs": (({},), "multimodal inputs are not supported in tokenmill"),
    "return_token_ids": ((False,), "not implemented yet; use /tokenize, or logprobs with "
                         "return_tokens_as_token_ids"),
    "functions": (([],), "the deprecated functions API is not supported; use tools"),
    "function_call": ((), "the deprecated functions API is not supported; use tool_choice"),
    "modalities": ((["text"],), "tokenmill produces text only"),
    "audio": ((), "tokenmill produces text only"),
    "prediction": ((), "predicted outputs are not supported in tokenmill"),
    "thinking_token_budget": ((), "a thinking budget is not implemented in tokenmill"),
    "echo": ((False,), "chat does not echo messages; use /v1/completions with echo"),
}

# field -> why it changes nothing here (logged once)
IGNORED: dict[str, str] = {
    "guided_decoding_backend": "tokenmill has one structured-output backend",
    "guided_whitespace_pattern": "tokenmill's structured-output backend uses its default whitespace",
    "store": "tokenmill stores no completions",
    "metadata": "tokenmill stores no completions",
    "service_tier": "tokenmill has one service tier",
}

_logged: set[str] = set()


def check_undeclared_fields(body: Any, declared: set[str], endpoint: str) -> None:
    """Refuse or log the fields of `body` that the request model does not declare.

    Args:
        body: the raw JSON body (anything but a dict is left to pydantic).
        declared: the request model's field names.
        endpoint: for the log line, e.g. "/v1/completions".

    Raises:
        InvalidFieldError: a field of `UNSUPPORTED` has a non-neutral value; the
            message names the field and says why, `param` is the field.
    """
    if not isinstance(body, dict):
        return
    for name, value in body.items():
        if name in declared:
            continue
        if name in UNSUPPORTED:
            neutral, why = UNSUPPORTED[name]
            if value is None or any(value == v and type(value) is type(v) for v in neutral):
                continue
            raise InvalidFieldError(name, f"The field `{name}` is not supported: {why}. Remove it from the request.")
        key = f"{endpoint}:{name}"
        if key in _logged:
            continue
        _logged.add(key)
        if name in IGNORED:
            logger.info("The request field %r is accepted and ignored on %s: %s.", name, endpoint, IGNORED[name])
        else:
            logger.warning("The following fields were present in the request but ignored: {%r} (%s is not a "
                           "field tokenmill knows on %s).", name, name, endpoint)
