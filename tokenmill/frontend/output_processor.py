"""OutputProcessor: engine-core token ids -> `RequestOutput`s users see.

Per request it detokenizes incrementally, applies stop strings (which the
core cannot see: it has no text), converts logprobs, and shapes each output
as CUMULATIVE, DELTA or FINAL_ONLY. Requests with n > 1 run in the core as n
children (`f"{i}_{parent_id}"`); their outputs are gathered under the parent id.

Text shown while a request runs lags the decoded text by up to
`max(len(stop)) - 1` chars so that a stop string split over tokens is never
half-streamed:

    decoded:  "Hello wor"        stop = ["world"] -> buffer 4
    shown:    "Hello"            ("_wor" held; "world" would be cut)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.messages import EngineCoreOutputs, EngineCoreRequest, FinishReason
from tokenmill.frontend.detokenizer import IncrementalDetokenizer
from tokenmill.frontend.logprobs import make_step_logprobs
from tokenmill.frontend.stop_checker import find_stop_string, stop_buffer_length
from tokenmill.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams


@dataclass(slots=True)
class ParentRequest:
    """An n > 1 request: the user's id, and the latest output of each child."""

    request_id: str
    n: int
    output_kind: RequestOutputKind
    child_outputs: dict[int, CompletionOutput] = field(default_factory=dict)  # index -> latest
    unfinished: set[int] = field(default_factory=set)  # indices still running


class RequestState:
    """Everything the output side tracks for one engine-core request."""

    def __init__(self, req: EngineCoreRequest, prompt: str | None, tokenizer: Any,
                 parent: ParentRequest | None, index: int) -> None:
        params: SamplingParams = req.sampling_params
        self.request_id = req.request_id
        self.parent = parent
        self.index = index
        self.prompt = prompt
        self.prompt_token_ids = req.prompt_token_ids
        self.params = params
        self.output_kind = params.output_kind
        self.detokenizer: IncrementalDetokenizer | None = None
        if params.detokenize and tokenizer is not None:
            self.detokenizer = IncrementalDetokenizer(tokenizer, req.prompt_token_ids, params.skip_special_tokens,
                                                      params.spaces_between_special_tokens)
        self.stop: list[str] = list(params.stop) if self.detokenizer is not None else []
        self.stop_buffer = stop_buffer_length(self.stop, params.include_stop_str_in_output)
        self.token_ids: list[int] = []
        self.text = ""  # decoded text after stop-string truncation
        self.want_logprobs = params.logprobs is not None
        # [None, {token_id: Logprob}, ...] once the core sent them (prompt_logprobs asked), else None.
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.logprobs: list[PositionLogprobs] = []
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.metrics = RequestMetrics(arrival_time=req.arrival_time)
        # DELTA bookkeeping: how much was already sent.
        self.sent_text_len = 0
        self.sent_tokens = 0
        self.sent_logprobs = 0

    def finished(self) -> bool:
        return self.finish_reason is not None

    def shown_text_len(self) -> int:
        """Chars of `text` users may see now (all, once finished)."""
        if self.finished():
            return len(self.text)
        return max(len(self.text) - self.stop_buffer, self.sent_text_len)

    def make_completion(self) -> CompletionOutput | None:
        """The completion as the output kind wants it now; None when nothing is due."""
        if self.finish_reason is None and self.output_kind == RequestOutputKind.FINAL_ONLY:
            return None
        end = self.shown_text_len()
        delta = self.output_kind == RequestOutputKind.DELTA
        text_start = self.sent_text_len if delta else 0
        tok_start = self.sent_tokens if delta else 0
        lp_start = self.sent_logprobs if delta else 0
        out = CompletionOutput(
            index=self.index,
            text=self.text[text_start:end],
            token_ids=self.token_ids[tok_start:],
            cumulative_logprob=self.cumulative_logprob if self.want_logprobs else None,
            logprobs=self.logprobs[lp_start:] if self.want_logprobs else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        self.sent_text_len, self.sent_tokens, self.sent_logprobs = end, len(self.token_ids), len(self.logprobs)
        return out


class OutputProcessor:
    """Turns `EngineCoreOutputs` into `RequestOutput`s.

    Args:
        tokenizer: a transformers fast tokenizer, or None (token ids only,
            no stop strings, empty text).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}
        # parent id -> child ids still known here
        self.parent_children: dict[str, set[str]] = {}

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def add_request(self, request: EngineCoreRequest, prompt: str | None, parent: ParentRequest | None = None,
                    index: int = 0) -> None:
        """Track a core request. For an n > 1 child pass its `parent` and `index`.

        Raises:
            ValueError: the request id is already in use.
        """
        if request.request_id in self.request_states:
            raise ValueError(f"Request id {request.request_id!r} is already running; use a unique id.")
        self.request_states[request.request_id] = RequestState(request, prompt, self.tokenizer, parent, index)
        if parent is not None:
            self.parents[parent.request_id] = parent
            self.parent_children.setdefault(parent.request_id, set()).add(request.request_id)
            parent.unfinished.add(index)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget requests (user ids or child ids); return the core ids to abort."""
        core_ids: list[str] = []
        for rid in request_ids:
            ids = self.parent_children.pop(rid, None)
            if ids is not None:
                self.parents.pop(rid, None)
            else:
                ids = {rid}
            for cid in ids:
                state = self.request_states.pop(cid, None)
                if state is not None:
                    core_ids.append(cid)
                    self._forget_child(state)
        return core_ids

    def process_outputs(self, engine_core_outputs: EngineCoreOutputs) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's new tokens.

        Returns:
            (outputs, reqs_to_abort): one `RequestOutput` per user request that
            has something to report this step (children of one parent are
            merged), and the core request ids that a stop string finished and
            the core must stop (they are still running there).
        """
        touched: dict[str, RequestState] = {}
        reqs_to_abort = self.update(engine_core_outputs, touched)
        return self.make_outputs(touched), reqs_to_abort

    def update(self, engine_core_outputs: EngineCoreOutputs, touched: dict[str, RequestState]) -> list[str]:
        """Apply one step's new tokens without building outputs; call `make_outputs(touched)` after.

        Several steps may be applied in a row (a front end that fell behind
        drains every queued step) before one `make_outputs`: each request then
        gets one output covering all of them (CUMULATIVE: the latest snapshot;
        DELTA: everything since its last output), with the same text, token
        ids and logprobs as step-by-step outputs would carry together.

        Args:
            touched: core request id -> state; the requests with something to
                report are added (first-touch order is the outputs' order).

        Returns:
            The core request ids a stop string finished (the core must stop them).
            A request that finished leaves `request_states` here, so later
            steps' tokens for it (the core ran ahead) are ignored.
        """
        now = engine_core_outputs.timestamp or time.time()
        reqs_to_abort: list[str] = []
        request_states = self.request_states
        final_only = RequestOutputKind.FINAL_ONLY
        for eco in engine_core_outputs.outputs:
            state = request_states.get(eco.request_id)
            if state is None:  # aborted or stopped here while the core ran ahead
                continue
            stopped_by_string = self._update(state, eco, now)
            if stopped_by_string and eco.finish_reason is None:
                reqs_to_abort.append(eco.request_id)
            if state.finish_reason is not None:
                del request_states[state.request_id]
                self._forget_child(state)
            elif state.parent is None and state.output_kind == final_only:
                continue  # running, and nothing is due before the end (the offline case)
            touched[state.request_id] = state
        return reqs_to_abort

    def make_outputs(self, touched: dict[str, RequestState]) -> list[RequestOutput]:
        """The `RequestOutput`s due for the requests `update` touched: one per user request, in first-touch order."""
        per_request: dict[str, RequestOutput] = {}
        for state in touched.values():
            completion = state.make_completion()
            ro = self._make_request_output(state, completion)
            if ro is None:
                continue
            key = ro.request_id
            prev = per_request.get(key)
            if prev is None:
                per_request[key] = ro
                continue
            if state.parent is not None and state.output_kind == RequestOutputKind.DELTA:
                prev.outputs.append(completion)
                prev.outputs.sort(key=lambda c: c.index)
            else:
                per_request[key] = prev = ro  # newer gathered snapshot supersedes
            prev.finished = ro.finished
        return list(per_request.values())

    # -- internals ---------------------------------------------------------

    def _update(self, state: RequestState, eco: Any, now: float) -> bool:
        """Add one step's tokens to `state`; True when a stop string finished it."""
        new_ids = eco.new_token_ids
        if eco.num_cached_tokens:
            state.num_cached_tokens = eco.num_cached_tokens
        if new_ids:
            metrics = state.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            token_ids = state.token_ids
            token_ids.extend(new_ids)
            metrics.num_generation_tokens = len(token_ids)
        if eco.prompt_logprob_token_ids is not None:
            state.prompt_logprobs = [None, *make_step_logprobs(self.tokenizer, eco.prompt_logprob_token_ids,
                                                               eco.prompt_logprobs, eco.prompt_token_ranks)]
        if state.want_logprobs and eco.new_logprob_token_ids:
            step_lps = make_step_logprobs(self.tokenizer, eco.new_logprob_token_ids, eco.new_logprobs,
                                          eco.new_sampled_token_ranks)
            state.logprobs.extend(step_lps)
            state.cumulative_logprob += sum(row[0] for row in eco.new_logprobs)
        stopped_by_string = False
        if state.detokenizer is not None and new_ids:
            # A stop token (EOS, stop_token_ids) ending the request adds no text,
            # unless include_stop_str_in_output asks for it (vLLM's rule).
            decode_ids = new_ids
            if eco.finish_reason == FinishReason.STOP and not state.params.include_stop_str_in_output:
                decode_ids = new_ids[:-1]
            new_text = state.detokenizer.decode(decode_ids)
            state.text += new_text
            if state.stop and len(state.token_ids) > state.params.min_tokens:
                hit = find_stop_string(state.text, len(new_text), state.stop, state.params.include_stop_str_in_output)
                if hit is not None:
                    stop_str, truncate_to = hit
                    state.text = state.text[:truncate_to]
                    state.finish_reason, state.stop_reason = "stop", stop_str
                    stopped_by_string = True
        if not stopped_by_string and eco.finish_reason is not None:
            state.finish_reason = str(eco.finish_reason)
            state.stop_reason = eco.stop_reason
        if state.finish_reason is not None:
            state.metrics.finished_time = now
        return stopped_by_string

    def _forget_child(self, state: RequestState) -> None:
        if state.parent is not None:
            children = self.parent_children.get(state.parent.request_id)
            if children is not None:
                children.discard(state.request_id)

    def _make_request_output(self, state: RequestState, completion: CompletionOutput | None) -> RequestOutput | None:
        parent = state.parent
        if parent is None:
            if completion is None:
                return None
            return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, [completion],
                                 completion.finished(), state.num_cached_tokens, state.metrics,
                                 state.prompt_logprobs)
        if completion is not None:
            parent.child_outputs[state.index] = completion
        if state.finished():
            parent.unfinished.discard(state.index)
        finished = not parent.unfinished
        if finished:
            self.parents.pop(parent.request_id, None)
            self.parent_children.pop(parent.request_id, None)
        kind = parent.output_kind
        if kind == RequestOutputKind.FINAL_ONLY:
            if not finished:
                return None
            outputs = [parent.child_outputs[i] for i in sorted(parent.child_outputs)]
        elif kind == RequestOutputKind.DELTA:
            if completion is None:
                return None
            outputs = [completion]
        else:
            outputs = [parent.child_outputs[i] for i in sorted(parent.child_outputs)]
        return RequestOutput(parent.request_id, state.prompt, state.prompt_token_ids, outputs, finished,
                             state.num_cached_tokens, state.metrics, state.prompt_logprobs)
