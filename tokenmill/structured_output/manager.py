"""StructuredOutputManager: the engine core's grammar state for every structured request.

Lives next to the scheduler in the engine core (one process; the workers only
get a bitmask), so tensor-parallel ranks all apply the same mask and a
preempted request keeps its matcher: the matcher has accepted exactly the
request's `output_token_ids`, which preemption does not discard.

Life of a structured request:

    add_request ─► submit(): compile on a background thread ─┐  (not scheduled yet)
    step():  pop_ready() ◄───────────────────────────────────┘  matcher made, -> scheduler
             (a request with a reasoning parser is unconstrained until its
              output has the reasoning-end tokens, e.g. "</think>")
             schedule() -> fill_bitmask(SchedulerOutput)     one batched fill, rows -> worker
             execute_model (worker masks the logits)
             update_from_output() -> accept_outputs()        matchers advance; a finished
                                                             structure finishes the request
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.outputs import EngineCoreOutput, EngineCoreOutputs, FinishReason
from tokenmill.structured_output.backend import GrammarBackend, bitmask_width
from tokenmill.structured_output.spec import StructuredOutputSpec, get_spec

if TYPE_CHECKING:
    from tokenmill.config.configs import EngineConfig, ModelConfig

logger = logging.getLogger(__name__)

# How long an idle step() waits for a compile before returning (the core loop calls it again).
_IDLE_WAIT_S = 0.05


class StructuredOutputManager:
    """Compiles grammars off the step thread and keeps one matcher per request.

    Args:
        engine_config: the `EngineConfig` (tokenizer source, vocab size, max_num_seqs).
        backend_factory: builds the `GrammarBackend` lazily, on the compile
            thread (tests pass one built from a tiny tokenizer).
    """

    def __init__(self, engine_config: EngineConfig, backend_factory: Any = None) -> None:
        self._model_config = engine_config.model_config
        self._max_rows = engine_config.scheduler_config.max_num_seqs
        self._backend_factory = backend_factory or self._default_backend
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        # req_id -> (request, future of its compiled grammar), in arrival order.
        self._pending: dict[str, tuple[Request, Future]] = {}
        # req_id -> xgrammar.GrammarMatcher of requests handed to the scheduler.
        self.matchers: dict[str, Any] = {}
        # req_id -> (reasoning-end token ids, recent output tail): requests still thinking; their
        # grammar starts after the end sequence (`StructuredOutputsParams.reasoning_end_token_ids`).
        self.thinking: dict[str, tuple[list[int], list[int]]] = {}
        self._bitmask: np.ndarray | None = None  # [max_num_seqs, ceil(V / 32)] int32, made with the backend
        self._batch_matcher: Any = None
        # Seconds spent filling bitmasks and advancing matchers (for the overhead benchmark).
        self.fill_time_s = 0.0
        self.accept_time_s = 0.0

    # ---- set-up ---------------------------------------------------------------

    def _default_backend(self) -> GrammarBackend:
        from tokenmill.model_loader.tokenizer import get_tokenizer

        tokenizer = get_tokenizer(self._model_config)
        if tokenizer is None:
            raise ValueError("Structured output needs a tokenizer; the engine was started with skip_tokenizer_init.")
        stop_ids = _stop_token_ids(self._model_config, tokenizer)
        hf = self._model_config.hf_config
        text_cfg = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
        return GrammarBackend(tokenizer, int(text_cfg.vocab_size), stop_ids)

    def backend(self) -> GrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                t0 = time.perf_counter()
                backend = self._backend_factory()
                self._bitmask = np.full((self._max_rows, bitmask_width(backend.vocab_size)), -1, np.int32)
                self._backend = backend
                logger.info("Structured output: xgrammar tokenizer info built in %.2f s",
                            time.perf_counter() - t0)
            return self._backend

    # ---- requests ---------------------------------------------------------------

    @staticmethod
    def spec_of(request: Request) -> StructuredOutputSpec | None:
        return get_spec(request.sampling_params.structured_outputs)

    def submit(self, request: Request, spec: StructuredOutputSpec) -> None:
        """Start compiling `spec` for `request`; the request waits here until it is ready."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-grammar")
        future = self._pool.submit(lambda: self.backend().compile(spec))
        self._pending[request.request_id] = (request, future)

    def has_pending(self) -> bool:
        return bool(self._pending)

    def pop_ready(self, wait: bool) -> tuple[list[Request], list[EngineCoreOutput]]:
        """Requests whose grammar compiled (matcher made) and outputs for those that failed.

        Args:
            wait: nothing else can run, so block up to 50 ms for the oldest compile
                instead of letting the core loop spin.
        """
        if not self._pending:
            return [], []
        if wait:
            wait_futures([next(iter(self._pending.values()))[1]], timeout=_IDLE_WAIT_S)
        ready, failed = [], []
        for req_id, (request, future) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[req_id]
            exc = future.exception()
            if exc is not None:
                logger.error("request %s: structured output failed to compile: %s", req_id, exc)
                failed.append(EngineCoreOutput(request_id=req_id, new_token_ids=[], finish_reason=FinishReason.ABORT))
                continue
            self.matchers[req_id] = self.backend().new_matcher(future.result())
            so = request.sampling_params.structured_outputs
            end_ids = so.reasoning_end_token_ids if so is not None else None
            if end_ids:
                self.thinking[req_id] = (list(end_ids), [])
            ready.append(request)
        return ready, failed

    def abort(self, req_ids: list[str]) -> None:
        """Forget aborted/finished requests (pending or running)."""
        for req_id in req_ids:
            pending = self._pending.pop(req_id, None)
            if pending is not None:
                pending[1].cancel()
            self.matchers.pop(req_id, None)
            self.thinking.pop(req_id, None)

    # ---- each step ----------------------------------------------------------------

    def fill_bitmask(self, scheduler_output: Any) -> None:
        """Set `structured_output_request_ids` and `grammar_bitmask` on the step's SchedulerOutput.

        Rows are filled for every scheduled structured request (a partial
        prefill chunk gets one too; the worker only uses rows of requests
        that sample). One batched call fills all rows on C++ threads.
        """
        if not self.matchers:
            return
        req_ids = [r for r, n in scheduler_output.num_scheduled_tokens.items()
                   if n > 0 and r in self.matchers and r not in self.thinking]
        if not req_ids:
            return
        t0 = time.perf_counter()
        n = len(req_ids)
        self.backend()
        assert self._bitmask is not None
        if n > self._bitmask.shape[0]:  # max_num_seqs was exceeded by a contract breach; grow rather than fail
            self._bitmask = np.full((n, self._bitmask.shape[1]), -1, np.int32)
        rows = self._bitmask[:n]
        if self._batch_matcher is None:
            self._batch_matcher = self.backend().new_batch_matcher()
        self._batch_matcher.batch_fill_next_token_bitmask([self.matchers[r] for r in req_ids], rows)
        scheduler_output.structured_output_request_ids = {r: i for i, r in enumerate(req_ids)}
        # A copy: the buffer is refilled next step while a worker process may still hold this one.
        scheduler_output.grammar_bitmask = rows.copy()
        self.fill_time_s += time.perf_counter() - t0

    def accept_outputs(self, outputs: EngineCoreOutputs, scheduler: Any) -> None:
        """Advance each matcher by its request's new tokens; finish requests whose structure ended.

        A token the grammar rejects (only possible when the mask was not
        applied, e.g. a worker without the hook) finishes the request with
        `stop` and a logged error rather than producing invalid output.
        """
        if not self.matchers:
            return
        t0 = time.perf_counter()
        to_finish: list[str] = []
        for out in outputs.outputs:
            matcher = self.matchers.get(out.request_id)
            if matcher is None:
                continue
            new_ids = self._past_reasoning(out.request_id, out.new_token_ids)
            for tok in new_ids:
                if matcher.is_terminated():
                    break
                if not matcher.accept_token(tok):
                    logger.error("request %s: token %d is not allowed by its grammar; stopping it",
                                 out.request_id, tok)
                    to_finish.append(out.request_id)
                    break
            if out.finish_reason is not None:
                self.matchers.pop(out.request_id, None)
                self.thinking.pop(out.request_id, None)
            elif out.request_id not in to_finish and matcher.is_terminated():
                to_finish.append(out.request_id)
        if to_finish:
            scheduler.finish_requests(to_finish, RequestStatus.FINISHED_STOPPED)
            for out in outputs.outputs:
                if out.request_id in to_finish and out.finish_reason is None:
                    out.finish_reason = FinishReason.STOP
            for req_id in to_finish:
                self.matchers.pop(req_id, None)
        self.accept_time_s += time.perf_counter() - t0

    def _past_reasoning(self, req_id: str, token_ids: list[int]) -> list[int]:
        """The tokens the grammar must see: none while the request is still thinking, then those after the end."""
        state = self.thinking.get(req_id)
        if state is None:
            return token_ids
        end_ids, tail = state
        for i, tok in enumerate(token_ids):
            tail.append(tok)
            del tail[: max(0, len(tail) - len(end_ids))]
            if tail == end_ids:
                del self.thinking[req_id]
                return token_ids[i + 1:]
        return []

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _stop_token_ids(model_config: ModelConfig, tokenizer: Any) -> list[int]:
    """EOS of the tokenizer plus the generation config's eos_token_id(s)."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    extra = (model_config.generation_config or {}).get("eos_token_id")
    if isinstance(extra, int):
        ids.add(extra)
    elif isinstance(extra, list):
        ids.update(int(x) for x in extra)
    return sorted(ids)
