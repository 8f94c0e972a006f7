"""The offline batch API: `LLM(model).generate(prompts, sampling_params)`, as vLLM's `LLM`.

Everything runs in this process (no server, no zmq). All prompts of a call
are queued at once and the engine batches them continuously; outputs come
back in input order.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from tokenmill.config import EngineArgs
from tokenmill.engine.gc_heap import gc_heap_frozen
from tokenmill.frontend.input_processor import PromptType
from tokenmill.frontend.llm_engine import LLMEngine
from tokenmill.frontend.chat_template import apply_chat_template
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams
from tokenmill.config.vllm_flags import check_compat_flags

Conversation = list[dict[str, Any]]


class LLM:
    """An engine for offline generation.

    Args:
        model: a local folder, a `.gguf` file, a hub repo id, or None for the
            bundled SmolLM2-135M-Instruct.
        **engine_kwargs: any `EngineArgs` field (vLLM's names): dtype,
            max_model_len, max_num_seqs, max_num_batched_tokens, block_size,
            kv_cache_memory_bytes, num_gpu_blocks_override, tokenizer,
            skip_tokenizer_init, load_format, seed, generation_config,
            enable_prefix_caching, quantization, kv_cache_dtype, ...

    Attributes:
        llm_engine: the `LLMEngine` (its `get_stats()` has the scheduler counters).

    Raises:
        ValueError: an unknown keyword, a vLLM argument for something not
            built yet (e.g. enable_lora), or an argument that does not fit the
            model or device. vLLM arguments with no meaning here (swap_space,
            ...) are accepted with a log line.
    """

    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        known = {f.name for f in dataclasses.fields(EngineArgs)}
        # vLLM arguments that mean nothing here are logged, unbuilt ones refused (config/vllm_flags.py).
        for name in check_compat_flags(engine_kwargs):
            if name not in known:
                engine_kwargs.pop(name)
        unknown = sorted(set(engine_kwargs) - known)
        if unknown:
            raise ValueError(f"Unknown LLM argument(s): {', '.join(unknown)}. Valid ones are EngineArgs fields: "
                             f"{', '.join(sorted(known - {'model'}))}.")
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_kwargs), usage="llm")
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams from the model's generation_config.json (vLLM defaults with generation_config="vllm")."""
        return self.llm_engine.get_default_sampling_params()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
                 priority: int | Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate completions for one prompt or a batch.

        Args:
            prompts: a str, a list of token ids, a dict ({"prompt": str} or
                {"prompt_token_ids": [...]}), or a list of these.
            sampling_params: one for all prompts, one per prompt, or None for
                `get_default_sampling_params()`.
            use_tqdm: show a progress bar.
            priority: one int for all prompts or one per prompt; smaller runs
                first under scheduling_policy="priority" (ties by arrival).
                Prefix-cache isolation: give dict prompts a "cache_salt".

        Returns:
            One finished `RequestOutput` per prompt, in input order.

        Raises:
            ValueError: a prompt or parameter is invalid (nothing is run), or
                the number of sampling params / priorities does not match.
        """
        prompt_list = _as_prompt_list(prompts)
        if isinstance(priority, int) and not isinstance(priority, bool):
            priority = [priority] * len(prompt_list)
        return self._run(prompt_list, sampling_params, use_tqdm, priority, add_special_tokens=True)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """Generate replies to one conversation or a batch of them.

        Args:
            messages: `[{"role": "user", "content": "..."}, ...]`, or a list of such lists.
            sampling_params, use_tqdm: as in `generate`.
            chat_template: a file path or Jinja text (default: --chat-template,
                else the tokenizer's).
            add_generation_prompt: end the prompt with the assistant turn's opening.
            chat_template_kwargs: extra template variables (e.g. `documents`).
            continue_final_message: continue the last message (e.g. a partial
                assistant reply) instead of opening a new turn; needs
                add_generation_prompt=False.

        Returns:
            One finished `RequestOutput` per conversation, in input order.

        Raises:
            ValueError: no chat template, or an invalid prompt/parameter, or
                both continue_final_message and add_generation_prompt.
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true; pass "
                             "add_generation_prompt=False to continue the last message.")
        kwargs = dict(chat_template_kwargs or {})
        if continue_final_message:
            kwargs["continue_final_message"] = True
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        template = chat_template if chat_template is not None else self.llm_engine.model_config.chat_template
        tokenizer = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conv in conversations:
            text = apply_chat_template(tokenizer, list(conv), chat_template=template,
                                       add_generation_prompt=add_generation_prompt, **kwargs)
            # The template wrote BOS and role markers itself; add nothing more.
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self._run(prompts, sampling_params, use_tqdm, None, add_special_tokens=False)

    def _run(self, prompts: list[PromptType], sampling_params: Any, use_tqdm: bool, priority: Sequence[int] | None,
             add_special_tokens: bool) -> list[RequestOutput]:
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"Got {len(priority)} priorities for {len(prompts)} prompts; give one per prompt.")
        if priority is not None and not all(isinstance(p, int) and not isinstance(p, bool) for p in priority):
            raise ValueError(f"Priorities must be integers, got {list(priority)!r}.")
        engine = self.llm_engine
        request_ids: list[str] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                request_id = str(next(self._request_counter))
                engine.add_request(request_id, prompt, params, priority[i] if priority else 0,
                                   add_special_tokens=add_special_tokens)
                request_ids.append(request_id)
        except Exception:
            engine.abort_request(request_ids)  # all or nothing: nothing half-queued stays behind
            raise
        return self._run_engine(request_ids, use_tqdm)

    def _params_per_prompt(self, sampling_params: Any, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * n
        elif len(sampling_params) != n:
            raise ValueError(f"Got {len(sampling_params)} sampling params for {n} prompts; "
                             "give one, or one per prompt.")
        out = []
        for p in sampling_params:
            if p is None:
                raise ValueError("sampling_params entries must be SamplingParams, not None.")
            p = p.clone()
            p.output_kind = RequestOutputKind.FINAL_ONLY  # offline callers only want the end result
            out.append(p)
        return out

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        pbar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            pbar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        num_generated = 0
        try:
            # Objects alive now (model, engine, these requests) skip the GC passes of the step loop.
            with gc_heap_frozen():
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            finished[out.request_id] = out
                            if pbar is not None:
                                num_generated += sum(len(c.token_ids) for c in out.outputs)
                                elapsed = pbar.format_dict["elapsed"] or 1e-9
                                pbar.set_postfix_str(f"output: {num_generated / elapsed:.1f} toks/s", refresh=False)
                                pbar.update(1)
        except BaseException:
            engine.abort_request(list(request_ids))  # Ctrl-C or an engine error: free everything
            raise
        finally:
            if pbar is not None:
                pbar.close()
        return [finished[rid] for rid in request_ids]


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    """One prompt or a sequence of prompts -> a list of prompts."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Sequence):
        if not prompts:
            raise ValueError("No prompts given; pass a string, a list of token ids, or a list of prompts.")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]  # a single token-id prompt
        return list(prompts)
    raise ValueError(f"Cannot use prompts of type {type(prompts).__name__}; pass a string, token ids, a dict, or a "
                     "list of these.")
