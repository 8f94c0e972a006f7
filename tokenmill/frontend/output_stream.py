"""OutputStream: the outputs of one or more requests, for one consumer, holding at most one pending output per request.

`AsyncLLM._flush_outputs` puts one `RequestOutput` per updated request per
batch of engine steps; a consumer that reads slower than that (a slow client)
must not make the stream grow with every step. A new output for a request
that still has one pending is merged into it:

    CUMULATIVE, FINAL_ONLY: the newer output replaces the pending one (it
                            already holds everything the older one did).
    DELTA:                  per completion index, text, token ids and logprobs
                            are appended; finish fields and cumulative_logprob
                            come from the newer.

    put r:"a"  put s:"x"  put r:"ab"  put r:"abc"   ->  pending  {r:"abc", s:"x"}

so memory holds one snapshot (or one accumulated delta) per request, and
consumers that diff against what they already sent see the same final text.
A request keeps the place of its oldest unread output, so requests are read
in the order their outputs first arrived. An error is delivered after the
outputs put before it: it closes the current run of pending outputs, and
outputs put after it start a new run.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING

from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from tokenmill.frontend.async_llm import AsyncLLM


class OutputStream:
    """The outputs of one or more requests, as an async iterator of `RequestOutput`.

    Iteration ends when every request in it has finished. `close()` aborts
    the unfinished ones (call it in a `finally`). An error for any request
    (`ValueError` from the core, `EngineDeadError`) is raised from `__anext__`
    / `next_ready` once the outputs put before it were returned. One consumer
    per stream.

    Attributes:
        unfinished: ids of this stream's requests whose finished output has
            not been read yet.
    """

    def __init__(self, llm: AsyncLLM) -> None:
        self._llm = llm
        self.unfinished: set[str] = set()
        self._delta_ids: set[str] = set()  # requests with DELTA outputs: merged by appending
        # Runs of pending outputs (request id -> its one merged output, in first-arrival order),
        # separated by errors. Without errors: at most one run.
        self._pending: deque[dict[str, RequestOutput] | BaseException] = deque()
        self._ready = asyncio.Event()  # set when `_pending` may be non-empty

    def add(self, request_id: str, output_kind: RequestOutputKind) -> None:
        """Expect outputs of `request_id` (of `output_kind`, which decides how pending ones merge)."""
        self.unfinished.add(request_id)
        if output_kind == RequestOutputKind.DELTA:
            self._delta_ids.add(request_id)

    def put(self, out: RequestOutput) -> None:
        """Queue `out`, merged into its request's pending output if it has one (see the module docstring)."""
        pending = self._pending
        run = pending[-1] if pending else None
        if not isinstance(run, dict):
            run = {}
            pending.append(run)
        rid = out.request_id
        prev = run.get(rid)
        if prev is not None and rid in self._delta_ids:
            merge_delta_output(prev, out)
        else:
            run[rid] = out  # an existing key keeps its place
        self._ready.set()

    def put_error(self, error: BaseException) -> None:
        """Queue `error`; the consumer gets it after the outputs queued before it."""
        self._pending.append(error)
        self._ready.set()

    def num_pending(self) -> int:
        """Outputs queued and not yet read (at most one per request between errors)."""
        return sum(len(item) for item in self._pending if isinstance(item, dict))

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> RequestOutput:
        """The oldest request's pending output. Raises StopAsyncIteration once every request has finished."""
        if not self.unfinished:
            raise StopAsyncIteration
        head = await self._head()
        rid = next(iter(head))
        out = head.pop(rid)
        if not head:
            self._pending.popleft()
        return self._take(out)

    async def next_ready(self) -> list[RequestOutput]:
        """Wait for an output, then take every output pending (one per request, oldest request first).

        A stream consumer that fell behind (a slow client, a busy event loop)
        gets all its requests' latest outputs at once and can send them as
        one chunk. Raises StopAsyncIteration when every request has finished,
        and a queued error (`ValueError`, `EngineDeadError`) once the outputs
        queued before it were returned.
        """
        if not self.unfinished:
            raise StopAsyncIteration
        await self._head()
        run = self._pending.popleft()
        assert isinstance(run, dict)
        return [self._take(out) for out in run.values()]

    async def _head(self) -> dict[str, RequestOutput]:
        """Wait for the first pending run; raise the error instead when one comes first."""
        pending = self._pending
        while not pending:
            self._ready.clear()
            await self._ready.wait()
        head = pending[0]
        if isinstance(head, BaseException):
            pending.popleft()
            raise head
        return head

    def _take(self, out: RequestOutput) -> RequestOutput:
        if out.finished:
            self.unfinished.discard(out.request_id)
            self._llm.forget_request(out.request_id)
        return out

    def close(self) -> None:
        """Abort every request of this stream that has not finished (idempotent)."""
        if self.unfinished:
            self._llm.abort_requests(sorted(self.unfinished))
            self.unfinished.clear()


def merge_delta_output(pending: RequestOutput, new: RequestOutput) -> None:
    """Fold DELTA output `new` into the unread `pending` one of the same request, in place.

    Per completion index: text, token ids and logprobs of `new` are appended;
    `cumulative_logprob`, `finish_reason` and `stop_reason` are taken from
    `new`. A completion index only `new` has is added (outputs stay ordered by
    index). Request-level fields come from `new` (`prompt_logprobs` only when
    it has them). The result equals what reading both would have given.
    `pending` and its completions must belong to the stream (made by one
    `make_outputs` call, not yet handed to a consumer).
    """
    by_index = {c.index: c for c in pending.outputs}
    added = False
    for comp in new.outputs:
        old = by_index.get(comp.index)
        if old is None:
            pending.outputs.append(comp)
            by_index[comp.index] = comp
            added = True
            continue
        append_delta_completion(old, comp)
    if added:
        pending.outputs.sort(key=lambda c: c.index)
    pending.finished = new.finished
    pending.num_cached_tokens = new.num_cached_tokens
    pending.metrics = new.metrics
    if new.prompt_logprobs is not None:
        pending.prompt_logprobs = new.prompt_logprobs


def append_delta_completion(old: CompletionOutput, new: CompletionOutput) -> None:
    """Fold DELTA completion `new` into `old` (the same choice's earlier, unsent part), in place: text, token ids
    and logprobs appended; `cumulative_logprob`, `finish_reason` and `stop_reason` taken from `new`. `old` must
    be its holder's own (not read elsewhere afterwards)."""
    old.text += new.text
    old.token_ids.extend(new.token_ids)
    if new.logprobs is not None:
        if old.logprobs is None:
            old.logprobs = list(new.logprobs)
        else:
            old.logprobs.extend(new.logprobs)
    old.cumulative_logprob = new.cumulative_logprob
    old.finish_reason = new.finish_reason
    old.stop_reason = new.stop_reason
