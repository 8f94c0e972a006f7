"""AsyncLLM: the server's engine handle (asyncio), with the engine core in another process.

    HTTP handler --generate()--> AsyncLLM (this process)          core process
                                 tokenize + InputProcessor  --ADD-->  EngineCore.step()
    async iterator <-- stream <- OutputProcessor (detokenize,  <--OUTPUTS--
                                 stop strings, logprobs)       --ABORT--> (stop strings,
                                                                          disconnects)

Tokenizing and detokenizing stay here so the core's loop only schedules and
runs the model. Each request's outputs go to an `OutputStream`
(output_stream.py), filled by the client's reader task, which holds at most
one pending (merged) output per request however slowly its consumer reads;
`generate()` drains it. Cancelling the consumer (a client disconnect) aborts
the request in the core, which frees its KV blocks.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from tokenmill.core.request import RequestStatus
from tokenmill.engine.messages import EngineCoreOutputs, MessageKind, SchedulerStats
from tokenmill.frontend.core_client import EngineCoreClient, EngineDeadError, ServerShuttingDownError
from tokenmill.frontend.input_processor import get_prompt_text
from tokenmill.frontend.output_stream import OutputStream
from tokenmill.frontend.parallel_sampling import make_child_requests
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.config.configs import EngineConfig
    from tokenmill.frontend.output_processor import RequestState

logger = logging.getLogger(__name__)


class AsyncLLM:
    """Asynchronous generation over an engine core in a separate process.

    Build with `await AsyncLLM.from_engine_args(engine_args)` (or
    `AsyncLLM(engine_config)` then `await start()`).

    Attributes:
        engine_config: the resolved `EngineConfig`.
        model_config: `engine_config.model_config`.
        tokenizer: the transformers tokenizer, or None (skip_tokenizer_init).
        scheduler_stats: the latest `SchedulerStats` the core sent (None
            before the first step).
    """

    def __init__(self, engine_config: EngineConfig, client: EngineCoreClient | None = None) -> None:
        import torch

        from tokenmill.frontend.input_processor import InputProcessor, get_default_sampling_kwargs
        from tokenmill.frontend.output_processor import OutputProcessor
        from tokenmill.model_loader.tokenizer import get_tokenizer

        # The core process does the math; the front end only needs one thread
        # so it does not compete with the core for the CPUs.
        torch.set_num_threads(1)
        self.engine_config = engine_config
        self.model_config = engine_config.model_config
        self.tokenizer = get_tokenizer(self.model_config)
        self.input_processor = InputProcessor(self.model_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        # The model's generation_config.json sampling defaults, for fields a
        # client leaves out ({} with --generation-config vllm).
        self.default_sampling_kwargs: dict[str, Any] = get_default_sampling_kwargs(self.model_config)
        self.client = client if client is not None else EngineCoreClient(engine_config)
        self.scheduler_stats: SchedulerStats | None = None
        # Optional metrics sink (entrypoints/openai/metrics.ServerMetrics): fed
        # scheduler stats, per-step token timings, finishes and aborts.
        self.stats_observer: Any = None
        # --enable-log-requests: one INFO line per request (prompt cut to max_log_len characters / token ids).
        self.log_requests = False
        self.max_log_len: int | None = None
        self._queues: dict[str, OutputStream] = {}  # user request id -> its stream, until its finished output is read
        # Core requests updated by the OUTPUTS messages read since the last `_flush_outputs`
        # (see EngineCoreClient.start_reader: one output per request per batch of messages).
        self._touched: dict[str, RequestState] = {}
        self._to_stop: list[str] = []  # core ids a stop string finished, to abort in the core at the flush

    @classmethod
    async def from_engine_args(cls, engine_args: Any, usage: str = "server") -> AsyncLLM:
        """Resolve `engine_args`, spawn the core and wait until it is ready.

        Raises:
            ValueError: an argument is invalid (from config resolution).
            EngineStartupError: the core could not start (its reason as text).
        """
        engine_config = engine_args.create_engine_config(usage)
        client = EngineCoreClient(engine_config)
        # The core loads the model while this process loads the tokenizer.
        client.launch()
        try:
            llm = cls(engine_config, client)
        except BaseException:
            client.shutdown()
            raise
        await llm.start()
        return llm

    async def start(self, timeout_s: float | None = None) -> None:
        """Spawn the core process, wait for READY, start reading outputs.

        Raises:
            EngineStartupError: see `EngineCoreClient.start`.
        """
        info = await self.client.start(timeout_s)
        logger.info("engine core ready: %s", info)
        self.client.start_reader(self._on_message, self._flush_outputs)

    @property
    def is_running(self) -> bool:
        return self.client.is_alive

    @property
    def max_model_len(self) -> int:
        return int(self.model_config.max_model_len)

    @property
    def vocab_size(self) -> int:
        return int(self.model_config.hf_config.vocab_size)

    async def check_health(self) -> None:
        """Raises EngineDeadError when the core process is gone or the task reading its outputs has stopped."""
        if not self.client.is_alive:
            raise EngineDeadError(self.client.dead_reason or "The engine core process is not running.")
        if not self.client.reader_running:
            raise EngineDeadError("The front end stopped reading the engine core's outputs.")

    def get_scheduler_stats(self) -> SchedulerStats | None:
        """The most recent `SchedulerStats` from the core (None before any step)."""
        return self.scheduler_stats

    def apply_chat_template(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                            add_generation_prompt: bool = True, sanitize_control_tokens: bool = False,
                            **kwargs: Any) -> list[int]:
        """Render chat messages with the model's template and tokenize them.

        `chat_template` is Jinja text and is never opened as a file (it may
        come from a request); None: `--chat-template` (a file or text), else
        the tokenizer's. Rendering is sandboxed and bounded (chat_template_sandbox.py).

        Returns:
            Prompt token ids (the template wrote any BOS; none is added).

        Raises:
            ValueError: no template, or the template rejects the messages.
        """
        from tokenmill.frontend.chat_template import resolve_chat_template
        from tokenmill.frontend.chat_template_sandbox import chat_prompt_ids

        template = chat_template if chat_template is not None else resolve_chat_template(self.model_config.chat_template)
        return chat_prompt_ids(self.tokenizer, template, messages, add_generation_prompt=add_generation_prompt,
                               sanitize_control_tokens=sanitize_control_tokens, **kwargs)

    def add_request(self, request_id: str, prompt: str | list[int] | dict[str, Any],
                    sampling_params: SamplingParams, priority: int = 0,
                    stream: OutputStream | None = None) -> OutputStream:
        """Validate and submit one request; its outputs go to `stream` (a new one if None).

        Several requests may share a stream (n > 1 fan-out, batched prompts):
        iterating it yields their `RequestOutput`s interleaved, in arrival
        order; an output not read before the next one arrives is merged into
        it (`OutputStream`), so a slow reader skips intermediate snapshots.

        Raises:
            ValueError: the request is invalid (too long, bad parameters,
                duplicate id); nothing was queued.
            EngineDeadError: the core process died.
        """
        if not self.client.is_alive:
            raise EngineDeadError(self.client.dead_reason or "The engine core process is not running.")
        if request_id in self._queues:
            raise ValueError(f"Request id {request_id!r} is already running; request ids must be unique.")
        request = self.input_processor.process(request_id, prompt, sampling_params, priority=priority)
        if self.log_requests:
            text, ids = get_prompt_text(prompt), request.prompt_token_ids
            cut = self.max_log_len
            logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s", request_id,
                        text[:cut] if text is not None and cut is not None else text, sampling_params,
                        list(ids[:cut]) if cut is not None else list(ids))
        if stream is None:
            stream = OutputStream(self)
        # n > 1 runs as n core requests; the OutputProcessor gathers them
        # back under request_id.
        parent, children = make_child_requests(request)
        prompt_text = get_prompt_text(prompt)
        for index, child in enumerate(children):
            self.output_processor.add_request(child, prompt_text, parent, index)
        self._queues[request_id] = stream
        stream.add(request_id, request.sampling_params.output_kind)
        try:
            for child in children:
                self.client.add_request(child)
        except BaseException:
            stream.unfinished.discard(request_id)
            self.abort_requests([request_id])
            raise
        return stream

    async def generate(self, prompt: str | list[int] | dict[str, Any], sampling_params: SamplingParams,
                       request_id: str, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Submit one request and yield its `RequestOutput`s until it finishes.

        Args:
            prompt: text, token ids, or a dict the `InputProcessor` accepts.
            sampling_params: its `output_kind` decides cumulative / delta /
                final-only outputs.
            request_id: unique among running requests.
            priority: smaller runs first under the priority policy.

        Raises:
            ValueError: the request is invalid; see `add_request`.
            EngineDeadError: the core process died.
        """
        stream = self.add_request(request_id, prompt, sampling_params, priority)
        try:
            async for out in stream:
                yield out
        finally:
            # Normal end, exception, or cancellation/aclose (client disconnect):
            # an unfinished request must leave the core so its blocks are freed.
            stream.close()

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort running requests (unknown ids are ignored); frees their blocks in the core."""
        ids = [rid for rid in request_ids if self._queues.pop(rid, None) is not None]
        if not ids:
            return
        observer = self.stats_observer
        if observer is not None:
            states = self.output_processor.request_states
            candidates = {rid: states.get(rid) for rid in ids}
            for rid in ids:  # n > 1 parents: their children's states
                for cid in self.output_processor.parent_children.get(rid, ()):
                    candidates[cid] = states.get(cid)
        core_ids = self.output_processor.abort_requests(ids)
        if observer is not None:
            observer.observe_aborted([candidates[c] for c in core_ids if candidates.get(c) is not None])
        self.client.abort_requests(core_ids)

    def abort_all(self, reason: str = "The server is shutting down; the request was aborted.") -> int:
        """Abort every request in flight (shutdown after its grace period). Returns how many.

        Their consumers get `ServerShuttingDownError(reason)` (HTTP 503, or an
        error event in a stream) instead of waiting forever.
        """
        streams = {id(s): s for s in self._queues.values()}
        ids = list(self._queues)
        self.abort_requests(ids)
        for stream in streams.values():
            stream.put_error(ServerShuttingDownError(reason))
        return len(ids)

    @property
    def num_requests_in_flight(self) -> int:
        """User requests that have not finished yet (each n > 1 request counts once)."""
        return len(self._queues)

    def _on_message(self, kind: bytes, obj: Any) -> None:
        """Reader-task callback: route one core message (see `serial.MessageKind`).

        OUTPUTS only update the requests' states; `_flush_outputs` (after the
        reader's batch, or before any other message) sends the outputs.
        """
        if kind == MessageKind.OUTPUTS:
            self._on_outputs(obj)
            return
        self._flush_outputs()
        if kind == MessageKind.REQUEST_ERROR:
            core_id, message = obj
            state = self.output_processor.request_states.get(core_id)
            user_id = state.parent.request_id if state is not None and state.parent is not None else core_id
            stream = self._queues.get(user_id)
            self.abort_requests([user_id])  # its other children too
            if stream is not None:
                stream.put_error(ValueError(message))
        elif kind == MessageKind.FATAL:
            # Shared streams appear once per request; one error each is enough.
            streams = {id(s): s for s in self._queues.values()}
            self._queues.clear()
            for stream in streams.values():
                stream.put_error(EngineDeadError(f"The engine core died: {obj}"))
        else:
            logger.warning("front end ignores engine-core message %r", kind)

    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        observer = self.stats_observer
        if outputs.scheduler_stats is not None:
            self.scheduler_stats = outputs.scheduler_stats
            if observer is not None:
                observer.observe_scheduler_stats(outputs.scheduler_stats)
        if not outputs.outputs:
            return
        seen = observer.observe_core_outputs(outputs, self.output_processor.request_states) \
            if observer is not None else None
        self._to_stop.extend(self.output_processor.update(outputs, self._touched))
        if seen:
            observer.observe_processed(seen)

    def _flush_outputs(self) -> None:
        """Send one `RequestOutput` per updated request to its stream; stop string-finished requests in the core.

        A stream whose consumer has not read the request's previous output
        merges the two (`OutputStream.put`), so it never holds more than one.
        """
        touched, to_stop = self._touched, self._to_stop
        try:
            if touched:
                self._touched = {}
                for out in self.output_processor.make_outputs(touched):
                    stream = self._queues.get(out.request_id)
                    if stream is not None:
                        stream.put(out)
        finally:  # even if building outputs failed: the core must free what stop strings finished
            if to_stop:
                self._to_stop = []
                # Stop strings finished these in the front end; free them in the core.
                self.client.abort_requests(to_stop, RequestStatus.FINISHED_STOPPED)

    def shutdown(self) -> None:
        """Stop the core process (idempotent)."""
        self.client.shutdown()
