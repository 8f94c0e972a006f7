"""InputProcessor: a user's prompt + SamplingParams -> a validated `EngineCoreRequest`.

Prompt forms (vLLM's): a string; a list of token ids; `{"prompt": str}`;
`{"prompt_token_ids": [...]}` (may also carry "prompt" text and "cache_salt").

Generation-config defaults: SamplingParams cannot tell a field the user set
from one left at its default, so the model's generation_config.json is
applied where the user gave no parameters at all: `LLM.generate(...,
sampling_params=None)` uses `LLM.get_default_sampling_params()`, built from
`get_default_sampling_kwargs(model_config)`; the HTTP server uses the same
dict for fields a client omitted. `--generation-config vllm` makes
`model_config.generation_config` `{}`, so no defaults apply. Every request,
whatever its params, gets the generation config's extra EOS ids as stop ids
(`SamplingParams.update_from_generation_config`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenmill.engine.messages import EngineCoreRequest
from tokenmill.sample.bad_words import tokenize_bad_words
from tokenmill.sampling_params import InvalidFieldError, SamplingParams
from tokenmill.structured_output.spec import validate_structured_outputs

if TYPE_CHECKING:
    from tokenmill.config.configs import ModelConfig

PromptType = str | list[int] | dict[str, Any]

# generation_config.json key -> SamplingParams field (as vLLM's get_diff_sampling_param).
_GEN_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def get_default_sampling_kwargs(model_config: ModelConfig) -> dict[str, Any]:
    """SamplingParams keyword defaults from the model's generation config ({} for "vllm").

    Only sampling fields are taken (temperature, top_p, top_k, min_p,
    repetition_penalty, max_new_tokens -> max_tokens); EOS ids are handled
    per request.
    """
    gen = model_config.generation_config or {}
    return {field: gen[key] for key, field in _GEN_CONFIG_KEYS.items() if gen.get(key) is not None}


def truncate_prompt(token_ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int) -> list[int]:
    """The last `truncate_prompt_tokens` ids of the prompt (-1: the last max_model_len; None: all).

    Raises:
        ValueError: truncate_prompt_tokens is above max_model_len.
    """
    if truncate_prompt_tokens is None:
        return token_ids
    if truncate_prompt_tokens > max_model_len:
        raise ValueError(f"truncate_prompt_tokens ({truncate_prompt_tokens}) is larger than this model's maximum "
                         f"context length ({max_model_len} tokens); give at most {max_model_len}, or -1 for "
                         "max_model_len.")
    keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    return token_ids[-keep:]


def get_prompt_text(prompt: PromptType) -> str | None:
    """The prompt's text as `RequestOutput.prompt` shows it (None for token-id prompts)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):
        text = prompt.get("prompt")
        return text if isinstance(text, str) else None
    return None


class InputProcessor:
    """Tokenizes and validates prompts.

    Args:
        model_config: a `ModelConfig` (max_model_len, hf_config.vocab_size,
            generation_config, max_logprobs, skip_tokenizer_init).
        tokenizer: a transformers tokenizer, or None with skip_tokenizer_init.
    """

    def __init__(self, model_config: ModelConfig, tokenizer: Any | None) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_model_len: int = model_config.max_model_len
        self.vocab_size: int = int(model_config.hf_config.vocab_size)
        self.generation_config: dict[str, Any] = model_config.generation_config or {}
        self.eos_token_id = self._find_eos_token_id()

    def _find_eos_token_id(self) -> int | None:
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            return int(self.tokenizer.eos_token_id)
        eos = getattr(self.model_config.hf_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return int(eos) if eos is not None else None

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> token ids (BOS etc. as the tokenizer adds them by default).

        Raises:
            ValueError: there is no tokenizer (skip_tokenizer_init).
        """
        if self.tokenizer is None:
            raise ValueError("Text prompts need a tokenizer, but the engine was started with skip_tokenizer_init; "
                             "send token ids (prompt_token_ids) instead.")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def process(self, request_id: str, prompt: PromptType, sampling_params: SamplingParams, priority: int = 0,
                cache_salt: str | None = None, add_special_tokens: bool = True) -> EngineCoreRequest:
        """Build the core request.

        Args:
            request_id: unique id.
            prompt: str, list[int], {"prompt": str} or {"prompt_token_ids": list[int]}.
            sampling_params: not modified; a clone with max_tokens filled and
                the EOS/stop ids set goes into the request.
            priority: smaller runs first under the priority policy.
            cache_salt: isolates this request's prefix-cache blocks.
            add_special_tokens: False for text that already holds them
                (a rendered chat template).

        Raises:
            ValueError: the prompt is of an unknown form, empty, has ids
                outside the vocabulary, or does not leave room for the
                completion within max_model_len; logprobs above max_logprobs.
        """
        token_ids, salt = self._prompt_token_ids(prompt, add_special_tokens)
        cache_salt = cache_salt if cache_salt is not None else salt
        params = sampling_params.clone()
        token_ids = truncate_prompt(token_ids, params.truncate_prompt_tokens, self.max_model_len)
        self._validate(token_ids, params)
        if params.bad_words:
            params.bad_words_token_ids = tokenize_bad_words(self.tokenizer, params.bad_words, self.vocab_size)
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(token_ids)
        params.update_from_generation_config(self.generation_config, self.eos_token_id)
        return EngineCoreRequest(request_id=request_id, prompt_token_ids=token_ids, sampling_params=params,
                                 priority=priority, cache_salt=cache_salt)

    def _prompt_token_ids(self, prompt: PromptType, add_special_tokens: bool) -> tuple[list[int], str | None]:
        salt = None
        if isinstance(prompt, dict):
            salt = prompt.get("cache_salt")
            if prompt.get("prompt_token_ids") is not None:
                prompt = list(prompt["prompt_token_ids"])
            elif isinstance(prompt.get("prompt"), str):
                prompt = prompt["prompt"]
            else:
                raise ValueError("A dict prompt needs a 'prompt' (text) or 'prompt_token_ids' (list of ints) key.")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("The prompt is empty; give at least one character or token.")
            return self.tokenize(prompt, add_special_tokens), salt
        if isinstance(prompt, (list, tuple)):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise ValueError("A token-id prompt must be a list of integers.")
            return list(prompt), salt
        raise ValueError(f"Cannot use a prompt of type {type(prompt).__name__}; pass a string, a list of token ids, "
                         "or a dict with 'prompt' or 'prompt_token_ids'.")

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        n = len(token_ids)
        if n == 0:
            raise ValueError("The prompt is empty (it tokenized to no tokens); give at least one token.")
        bad = next((t for t in token_ids if t < 0 or t >= self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"Token id {bad} is out of vocabulary; this model's token ids are 0 .. "
                             f"{self.vocab_size - 1}.")
        if n >= self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                             f"prompt is {n} tokens, which leaves no room for the completion. Please reduce the "
                             "length of the prompt (or raise --max-model-len if the model allows it).")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise InvalidFieldError("max_tokens", f"This model's maximum context length is {self.max_model_len} "
                                    f"tokens. However, you requested {n + params.max_tokens} tokens ({n} in the "
                                    f"messages, {params.max_tokens} in the completion). Please reduce the length of "
                                    "the messages or completion.")
        max_logprobs = getattr(self.model_config, "max_logprobs", 20)
        if params.logprobs is not None and params.logprobs > max_logprobs:
            raise ValueError(f"Requested {params.logprobs} logprobs, but at most {max_logprobs} are allowed; "
                             "ask for fewer or start the engine with a larger --max-logprobs.")
        if params.prompt_logprobs is not None and params.prompt_logprobs > max_logprobs:
            raise ValueError(f"Requested {params.prompt_logprobs} prompt_logprobs, but at most {max_logprobs} "
                             "are allowed; ask for fewer or start the engine with a larger --max-logprobs.")
        validate_structured_outputs(params.structured_outputs)
        if params.stop and (self.tokenizer is None or not params.detokenize):
            raise ValueError("Stop strings need detokenized text; they cannot be used with skip_tokenizer_init or "
                             "detokenize=False (use stop_token_ids instead).")
