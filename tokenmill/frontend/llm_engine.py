"""LLMEngine: the synchronous, one-process engine behind the offline `LLM`.

    add_request: prompt -> InputProcessor -> (n children) -> OutputProcessor + EngineCore
    step():      EngineCore.step() -> OutputProcessor -> list[RequestOutput]
                 (requests a stop string ended are finished in the core)
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from tokenmill.core.request import RequestStatus
from tokenmill.engine.core import EngineCore
from tokenmill.engine.messages import SchedulerStats
from tokenmill.frontend.input_processor import InputProcessor, PromptType, get_default_sampling_kwargs, get_prompt_text
from tokenmill.frontend.output_processor import OutputProcessor
from tokenmill.frontend.parallel_sampling import make_child_requests
from tokenmill.model_loader.tokenizer import get_tokenizer
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.config.configs import EngineConfig
    from tokenmill.executor.abstract import Executor

logger = logging.getLogger(__name__)


class LLMEngine:
    """Tokenize, schedule, run and detokenize in the calling thread.

    Args:
        engine_config: a resolved `EngineConfig`.
        executor_class: override the executor (tests).

    Attributes:
        tokenizer: the transformers tokenizer (None with skip_tokenizer_init).
        engine_core: the `EngineCore` (scheduler + executor).
        stats: the latest `SchedulerStats` (cumulative counters: preemptions,
            chunked-prefill steps, max running requests, prefix-cache hits).
    """

    def __init__(self, engine_config: EngineConfig, executor_class: type[Executor] | None = None) -> None:
        self.engine_config = engine_config
        self.model_config = engine_config.model_config
        self.tokenizer = get_tokenizer(self.model_config)
        self.input_processor = InputProcessor(self.model_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = EngineCore(engine_config, executor_class)
        self.stats: SchedulerStats = self.engine_core.get_stats()

    @classmethod
    def from_engine_args(cls, engine_args: Any, usage: str = "llm") -> LLMEngine:
        """Resolve `EngineArgs` and build the engine (loads the model).

        Raises:
            ValueError: an argument does not fit this model or device.
        """
        return cls(engine_args.create_engine_config(usage))

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation-config defaults (none with generation_config "vllm")."""
        return SamplingParams(**get_default_sampling_kwargs(self.model_config))

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0,
                    add_special_tokens: bool = True, cache_salt: str | None = None) -> None:
        """Validate, tokenize and queue one request (n > 1 becomes n core requests).

        `priority`: smaller runs first under the priority policy. `cache_salt`
        (or a dict prompt's "cache_salt") isolates its prefix-cache blocks.

        Raises:
            ValueError: invalid prompt or parameters, or a duplicate id.
        """
        if request_id in self.output_processor.request_states or request_id in self.output_processor.parents:
            raise ValueError(f"Request id {request_id!r} is already running; use a unique id.")
        request = self.input_processor.process(request_id, prompt, params, priority=priority,
                                               cache_salt=cache_salt, add_special_tokens=add_special_tokens)
        prompt_text = get_prompt_text(prompt)
        parent, children = make_child_requests(request)
        for index, child in enumerate(children):
            self.output_processor.add_request(child, prompt_text, parent, index)
            self.engine_core.add_request(child)

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests (user ids); their blocks are freed. Unknown ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.engine_core.abort_requests(self.output_processor.abort_requests(ids))

    def step(self) -> list[RequestOutput]:
        """One engine step; the outputs of requests that progressed (per their output_kind)."""
        core_outputs = self.engine_core.step()
        if core_outputs.scheduler_stats is not None:
            self.stats = core_outputs.scheduler_stats
        if not core_outputs.outputs:
            return []
        outputs, reqs_to_abort = self.output_processor.process_outputs(core_outputs)
        if reqs_to_abort:
            self.engine_core.abort_requests(reqs_to_abort, RequestStatus.FINISHED_STOPPED)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        """Current scheduler gauges and cumulative counters."""
        return self.engine_core.get_stats()

    @property
    def num_preemptions(self) -> int:
        return self.get_stats().num_preemptions

    @property
    def num_chunked_prefill_steps(self) -> int:
        return self.get_stats().num_chunked_prefill_steps

    @property
    def max_num_running_reqs(self) -> int:
        return self.get_stats().max_num_running_reqs

    def shutdown(self) -> None:
        self.engine_core.shutdown()
