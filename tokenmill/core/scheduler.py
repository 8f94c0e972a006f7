"""Scheduler: continuous batching over a paged KV cache (pure Python, no torch).

One counter drives everything (docs/architecture.md): each step a request gets
`num_new_tokens` so that `num_computed_tokens` catches up with `num_tokens`
(prompt + output so far). There is no prefill or decode phase; a step mixes
prefill chunks and decodes under two limits, `max_num_batched_tokens` (the
token budget) and `max_num_seqs` (running requests).

Policy of `schedule()` (as vLLM v1's scheduler):

1. RUNNING requests first, in the order they were admitted. Each gets
   `min(num_tokens - num_computed_tokens, remaining budget,
   max_model_len - num_computed_tokens)` tokens, so every decode gets its
   token before any new prefill takes budget. If the KV cache cannot hold
   them, a victim is preempted and allocation retried: FCFS -> the newest
   running request (last in the list); priority -> the running request with
   the largest `(priority, arrival_time)`. A victim's blocks are freed, its
   `num_computed_tokens` reset to 0 (its KV is recomputed later, possibly
   partly from the prefix cache), and it goes back to the front of the
   waiting queue (FCFS) or into the priority queue. If the request being
   scheduled is itself the victim, the running pass stops.
2. WAITING requests next, only if nothing was preempted this step, in FCFS
   order or priority order (smaller `priority` first, then earlier arrival),
   while budget and `max_num_seqs` allow: prefix-cache lookup, then as many
   tokens as the budget allows (chunked prefill; with chunked prefill off, a
   prompt that does not fit in the remaining budget waits, and so does
   everyone behind it), then allocation. The first request that cannot be
   admitted stops the pass (head-of-line order is kept).

Stall-free batching (`max_prefill_tokens_with_decodes` > 0; Sarathi-Serve,
Agrawal et al., OSDI 2024): when a running request is decoding (exactly one
token left to compute) at the start of the step, the step's prefill tokens,
running chunks and new admissions together, are capped at that many, so a
long prompt cannot make every running decode wait for a full-budget step; a
step without decodes keeps the whole `max_num_batched_tokens`. A prefill
token here is one of a request with more than one token left (a prompt, or a
preempted request's recompute). The first prefill that fits still gets
min(cap, its tokens) each step, so prefills keep moving.

New and resumed requests go to the worker in full (`scheduled_new_reqs`),
running ones as diffs (`scheduled_cached_reqs`). Ids of requests finished,
aborted or preempted since the last non-empty output go in `finished_req_ids`
so the worker drops them (the worker must drop them before adding this
step's new requests: a preempted id may come back as new later). By the end
of `schedule()` each scheduled request's `num_computed_tokens` is advanced by
its scheduled tokens (the output carries the values from before; a victim
already scheduled in the same step is rolled back before it is freed).

Async scheduling (`async_scheduling`): the engine schedules step N+1
before step N's sampled ids reach the host. A request that samples in a
step carries one output placeholder until `update_from_output` of that
step; the placeholder counts as a known token, so the next step schedules
the request's decode (its input id is taken from step N's sampled ids on
the device). A request whose placeholders already reach `max_tokens` or
`max_model_len` is not scheduled again; one that stops on a stop token
(EOS) has computed one token too many, which is dropped. Requests whose
sampling reads their outputs (`Request.needs_sync`) are counted in
`num_sync_requests`; the engine runs synchronous steps while any exists.

`update_from_output` appends sampled tokens and applies the stop rules, in
this order after each token: a token in `all_stop_token_ids` (once
`min_tokens` are out; EOS is ignored under `ignore_eos`) -> STOP, with
`stop_reason` the token id, or None for the EOS id; then `max_tokens` or
`max_model_len` reached -> LENGTH. A request whose last token is EOS thus
reports "stop" even when it also hit its length.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from tokenmill.config.configs import CacheConfig, SchedulerConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.request_queue import create_request_queue
from tokenmill.core.sched_output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from tokenmill.core.outputs import EngineCoreOutput, EngineCoreOutputs, SchedulerStats


class Scheduler:
    """Decides, each step, which requests run and how many tokens each computes.

    Args:
        scheduler_config: `max_num_seqs`, `max_num_batched_tokens`,
            `max_model_len`, `enable_chunked_prefill`, `long_prefill_token_threshold`,
            `max_prefill_tokens_with_decodes`, `policy`, `async_scheduling`.
        cache_config: `block_size`, `enable_prefix_caching`.
        num_gpu_blocks: KV-cache blocks the worker allocated.

    Raises:
        ValueError: if the policy is unknown, a limit is not positive, or
            chunked prefill is off while `max_num_batched_tokens` <
            `max_model_len` (a long prompt could never be scheduled), or
            a prefill cap is negative, above the budget, or set without
            chunked prefill.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_gpu_blocks: int) -> None:
        cfg = scheduler_config
        if cfg.max_num_seqs < 1 or cfg.max_num_batched_tokens < 1 or cfg.max_model_len < 1:
            raise ValueError(
                f"max_num_seqs ({cfg.max_num_seqs}), max_num_batched_tokens ({cfg.max_num_batched_tokens}) "
                f"and max_model_len ({cfg.max_model_len}) must all be positive."
            )
        if not cfg.enable_chunked_prefill and cfg.max_num_batched_tokens < cfg.max_model_len:
            raise ValueError(
                f"With chunked prefill disabled, max_num_batched_tokens ({cfg.max_num_batched_tokens}) must be at "
                f"least max_model_len ({cfg.max_model_len}), or long prompts could never run; raise "
                "--max-num-batched-tokens, lower --max-model-len, or enable chunked prefill."
            )
        if cfg.long_prefill_token_threshold < 0 or (cfg.long_prefill_token_threshold
                                                     and not cfg.enable_chunked_prefill):
            raise ValueError(f"long_prefill_token_threshold ({cfg.long_prefill_token_threshold}) must be >= 0, "
                             "and > 0 only with chunked prefill (it splits prompts over steps).")
        cap = cfg.max_prefill_tokens_with_decodes
        if not 0 <= cap <= cfg.max_num_batched_tokens or (cap and not cfg.enable_chunked_prefill):
            raise ValueError(f"max_prefill_tokens_with_decodes ({cap}) must be between 0 (off) and "
                             f"max_num_batched_tokens ({cfg.max_num_batched_tokens}), and > 0 only with chunked "
                             "prefill (it splits prompts over steps).")
        self.scheduler_config = cfg
        self.cache_config = cache_config
        self.max_num_seqs = cfg.max_num_seqs
        self.max_num_batched_tokens = cfg.max_num_batched_tokens
        self.max_model_len = cfg.max_model_len
        self.enable_chunked_prefill = cfg.enable_chunked_prefill
        # > 0: a request's chunk per step is capped here (vLLM's long_prefill_token_threshold).
        self.long_prefill_cap = cfg.long_prefill_token_threshold or max(cfg.max_num_batched_tokens, 1)
        # > 0: a step with running decodes takes at most this many prefill tokens (module docstring); 0: off.
        self.prefill_cap_with_decodes = cfg.max_prefill_tokens_with_decodes
        self.policy = cfg.policy
        self.async_scheduling = cfg.async_scheduling
        # Unfinished requests with Request.needs_sync set (the engine keeps steps synchronous while > 0).
        self.num_sync_requests = 0
        self.waiting = create_request_queue(cfg.policy)
        self.running: list[Request] = []
        # req_id -> Request, for every unfinished request
        self.requests: dict[str, Request] = {}
        # Finished/aborted since the last schedule(); sent so the worker drops them.
        self.finished_req_ids: set[str] = set()
        self.kv_cache_manager = KVCacheManager(
            num_blocks=num_gpu_blocks,
            block_size=cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
            max_model_len=cfg.max_model_len,
            sliding_window=cache_config.sliding_window_group,
        )
        self.hybrid = cache_config.sliding_window_group is not None
        self.num_preemptions = 0
        self.num_chunked_prefill_steps = 0
        self.max_num_running_reqs = 0
        self.num_steps = 0

    # ------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        """Queue a new request.

        Raises:
            ValueError: if its id is already in use, its prompt is empty, or
                the prompt is longer than `max_model_len`.
        """
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already in use; request ids must be unique.")
        if request.num_prompt_tokens == 0:
            raise ValueError("The prompt is empty; give at least one token.")
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"The prompt has {request.num_prompt_tokens} tokens, more than max_model_len "
                f"({self.max_model_len}); shorten it or raise --max-model-len."
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)
        if request.needs_sync:
            self.num_sync_requests += 1

    def finish_requests(self, req_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """End requests from outside (abort, or a stop string the engine matched).

        Frees their blocks. Unknown or already finished ids are ignored.

        Raises:
            ValueError: if `finished_status` is not a finished status.
        """
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finish_requests needs a FINISHED_* status, got {finished_status!r}.")
        if isinstance(req_ids, str):
            req_ids = (req_ids,)
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = finished_status
            self._free_request(request)

    def has_unfinished_requests(self) -> bool:
        return len(self.waiting) + len(self.running) > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks; only possible when no request holds blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts (policy: module docstring).

        Returns:
            The `SchedulerOutput` for the worker; `total_num_scheduled_tokens`
            may be 0 when nothing can run.
        """
        # Hot path (every running request, every step): locals instead of
        # attribute lookups, the diff lists built in place, each request's
        # num_computed_tokens advanced as soon as its entry is recorded.
        kv = self.kv_cache_manager
        allocate_slots = kv.allocate_slots
        noop_end_get = kv.noop_end.get
        max_model_len = self.max_model_len
        async_scheduling = self.async_scheduling
        token_budget = self.max_num_batched_tokens
        long_prefill_cap = self.long_prefill_cap
        # Prefill tokens this step may still take: the whole budget, or the stall-free cap beside decodes.
        prefill_budget = token_budget
        if 0 < self.prefill_cap_with_decodes < token_budget and self._has_decode():
            prefill_budget = self.prefill_cap_with_decodes
        num_scheduled: dict[str, int] = {}
        cached = CachedRequestData()
        cached_req_ids, cached_new_blocks, cached_computed = (
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens)
        scheduled_new: list[NewRequestData] = []
        preempted: list[Request] = []
        # Scheduled requests whose span stops short of their known tokens (partial prefill chunks).
        num_partial = 0

        # 1. Running requests, in admission order.
        running = self.running
        i = 0
        while i < len(running) and token_budget > 0:
            request = running[i]
            num_computed = request.num_computed_tokens
            placeholders = request.num_output_placeholders
            num_known = len(request.all_token_ids) + placeholders
            if placeholders and self._last_token_in_flight(request, num_known):
                i += 1  # its last token is already being sampled
                continue
            num_left = num_known - num_computed
            # min(num_left, token_budget, max_model_len - num_computed), spelled
            # out: builtin min() costs ~10x a comparison on Python 3.11.
            num_new = num_left if num_left < token_budget else token_budget  # noqa: FURB136
            if long_prefill_cap < num_new:  # noqa: PLR1730
                num_new = long_prefill_cap
            if num_left > 1 and prefill_budget < num_new:  # a prefill chunk (a decode has one token left)
                num_new = prefill_budget
            if max_model_len - num_computed < num_new:  # noqa: PLR1730
                num_new = max_model_len - num_computed
            if num_new <= 0:
                i += 1
                continue
            if num_computed + num_new <= noop_end_get(request.request_id, -1):
                block_ids = []  # allocate_slots would do nothing (see KVCacheManager.noop_end)
            else:
                while (block_ids := allocate_slots(request, num_new)) is None:
                    victim = self._pick_victim()
                    victim_index = running.index(victim)
                    running.pop(victim_index)
                    if victim_index < i:  # already scheduled this step: undo it, take its budget back
                        i -= 1
                        n, was_partial = self._unschedule(victim, num_scheduled, cached)
                        token_budget += n
                        num_partial -= was_partial
                        if n > 1 or was_partial:  # it had more than one token left: a prefill chunk
                            prefill_budget += n
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is request:
                        break
                if block_ids is None:
                    break
            cached_req_ids.append(request.request_id)
            cached_new_blocks.append(block_ids)
            if self.hybrid:
                cached.new_swa_block_ids.append(kv.pop_new_swa_block_ids(request.request_id))
            cached_computed.append(num_computed)
            num_scheduled[request.request_id] = num_new
            if num_new < num_left:
                num_partial += 1
            elif async_scheduling:
                request.num_output_placeholders = placeholders + 1
            # Advanced here, after its entry holds the value from before (the worker's contract).
            request.num_computed_tokens = num_computed + num_new
            token_budget -= num_new
            if num_left > 1:
                prefill_budget -= num_new
            i += 1

        # 2. Waiting requests, only when nobody had to be preempted.
        if not preempted:
            # Every token of an admitted request is a prefill token.
            waiting_budget = token_budget if token_budget < prefill_budget else prefill_budget
            left, num_partial_new = self._schedule_waiting(waiting_budget, num_scheduled, scheduled_new)
            token_budget -= waiting_budget - left
            num_partial += num_partial_new

        total = self.max_num_batched_tokens - token_budget
        finished = self.finished_req_ids | {r.request_id for r in preempted} if preempted else self.finished_req_ids
        # An empty step may never reach the worker (the engine can skip it), so
        # its finished ids are sent again with the next step; dropping an id
        # twice, or one the worker never saw, must be harmless.
        self.finished_req_ids = set(finished) if total == 0 else set()
        self.num_steps += 1
        self.max_num_running_reqs = max(self.max_num_running_reqs, len(running))
        if num_partial:
            self.num_chunked_prefill_steps += 1
        return SchedulerOutput(
            scheduled_new_reqs=scheduled_new,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total,
            finished_req_ids=finished,
        )

    def _schedule_waiting(self, token_budget: int, num_scheduled: dict[str, int],
                          scheduled_new: list[NewRequestData]) -> tuple[int, int]:
        """Admit waiting requests in queue order while budget, blocks and max_num_seqs allow.

        Fills `num_scheduled` and `scheduled_new` and advances each admitted
        request's num_computed_tokens (past its prefix-cache hits and this
        step's tokens). Returns (the budget left, how many admitted requests
        got a partial prefill chunk).
        """
        kv = self.kv_cache_manager
        max_model_len = self.max_model_len
        num_partial = 0
        while len(self.waiting) > 0 and token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, max_model_len - num_hit_tokens)
            if not self.enable_chunked_prefill and num_new > token_budget:
                break
            num_new = min(num_new, token_budget, self.long_prefill_cap)
            assert num_new > 0
            block_ids = kv.allocate_slots(request, num_new, num_hit_tokens, hit_blocks)
            if block_ids is None:
                break
            self.waiting.pop()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
                request.scheduled_time = time.time()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled_new.append(NewRequestData(
                req_id=request.request_id,
                prompt_token_ids=list(request.prompt_token_ids),
                output_token_ids=list(request.output_token_ids),
                sampling_params=request.sampling_params,
                block_ids=kv.get_block_ids(request.request_id),
                num_computed_tokens=num_hit_tokens,
                swa_block_ids=kv.get_block_ids(request.request_id, swa=True) if self.hybrid else [],
            ))
            kv.pop_new_swa_block_ids(request.request_id)
            num_scheduled[request.request_id] = num_new
            if num_hit_tokens + num_new < request.num_tokens:
                num_partial += 1
            elif self.async_scheduling:
                request.num_output_placeholders = 1
            request.num_computed_tokens = num_hit_tokens + num_new
            token_budget -= num_new
        return token_budget, num_partial

    def _has_decode(self) -> bool:
        """Whether a running request has exactly one token left to compute (a decode), not counting one
        whose final token is already being sampled (async scheduling: the loop skips it).

        Stops at the first: under load most running requests decode, so this
        reads one or two of them.
        """
        for r in self.running:
            num_known = len(r.all_token_ids) + r.num_output_placeholders
            if num_known - r.num_computed_tokens == 1 and not (
                    r.num_output_placeholders and self._last_token_in_flight(r, num_known)):
                return True
        return False

    def _last_token_in_flight(self, request: Request, num_known: int) -> bool:
        """Async scheduling: the request's final token (max_tokens or max_model_len) is already being sampled,
        so it has nothing left to schedule (call only when it has output placeholders)."""
        return (len(request.output_token_ids) + request.num_output_placeholders >= request.max_tokens
                or num_known >= self.max_model_len)

    @staticmethod
    def _unschedule(request: Request, num_scheduled: dict[str, int], cached: CachedRequestData) -> tuple[int, int]:
        """Undo a running request's entry of this step; returns (its tokens, 1 if it was a partial chunk else 0)."""
        n = num_scheduled.pop(request.request_id)
        request.num_computed_tokens -= n
        request.num_output_placeholders = 0  # (the caller preempts it next)
        j = cached.req_ids.index(request.request_id)
        del cached.req_ids[j], cached.new_block_ids[j], cached.num_computed_tokens[j]
        if cached.new_swa_block_ids:
            del cached.new_swa_block_ids[j]
        return n, int(request.num_computed_tokens + n < request.num_tokens)

    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        # A token still being sampled for it is appended when it arrives; the recompute covers it.
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    # ------------------------------------------------------------------ update

    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        """Append the sampled tokens, apply stop rules, free finished requests.

        Args:
            scheduler_output: the output of the `schedule()` this step ran.
            model_runner_output: what the worker produced for it.

        Returns:
            One `EngineCoreOutput` per request that got tokens this step
            (finished ones carry `finish_reason`), plus scheduler stats.
        """
        mro = model_runner_output
        requests = self.requests
        index_of = mro.req_id_to_index
        sampled_token_ids = mro.sampled_token_ids
        lp = mro.logprobs
        check_stop = self._check_stop
        max_model_len = self.max_model_len
        first_finished = RequestStatus.FINISHED_STOPPED  # statuses from here on are finished
        outputs: list[EngineCoreOutput] = []
        finished: list[Request] = []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id)
            index = index_of.get(req_id)
            if request is None or index is None or request.status >= first_finished:
                continue  # aborted meanwhile, or not run
            sampled = sampled_token_ids[index]
            if not sampled:
                continue  # partial prefill chunk
            if request.num_output_placeholders:
                request.num_output_placeholders -= 1
            if len(sampled) == 1:  # every step without speculative decoding
                token_id = sampled[0]
                output_token_ids = request.output_token_ids
                output_token_ids.append(token_id)
                all_token_ids = request.all_token_ids
                all_token_ids.append(token_id)
                # _check_stop only when a stop token or a length limit is hit (cheap pre-test).
                stopped = (token_id in request.sampling_params.all_stop_token_ids
                           or len(output_token_ids) >= request.max_tokens
                           or len(all_token_ids) >= max_model_len) and check_stop(request)
                new_token_ids = [token_id]
            else:
                new_token_ids = []
                for token_id in sampled:
                    request.append_output_token_ids([token_id])
                    new_token_ids.append(token_id)
                    if stopped := check_stop(request):
                        break
            # Fields left at their defaults are not passed: keyword construction
            # costs ~1 us per output, a third of this loop at batch 256.
            out = EngineCoreOutput(req_id, new_token_ids)
            if stopped:
                out.finish_reason = request.get_finished_reason()
            if request.stop_reason is not None:
                out.stop_reason = request.stop_reason
            if request.num_cached_tokens > 0:
                out.num_cached_tokens = request.num_cached_tokens
            if len(request.output_token_ids) == len(new_token_ids):
                # First output of the request: report when it left the queue.
                out.scheduled_time = request.scheduled_time
            if lp is not None and index < len(lp.logprob_token_ids) and lp.logprob_token_ids[index]:
                out.new_logprob_token_ids = [lp.logprob_token_ids[index]]
                out.new_logprobs = [lp.logprobs[index]]
                out.new_sampled_token_ranks = [lp.sampled_token_ranks[index]]
            if mro.prompt_logprobs_dict and (plp := mro.prompt_logprobs_dict.get(req_id)) is not None:
                out.prompt_logprob_token_ids = plp.logprob_token_ids
                out.prompt_logprobs = plp.logprobs
                out.prompt_token_ranks = plp.sampled_token_ranks
            outputs.append(out)
            if stopped:
                finished.append(request)
        if finished:
            gone = set(map(id, finished))
            running = [r for r in self.running if id(r) not in gone]
            if len(running) + len(finished) != len(self.running):
                # Async scheduling: a request preempted after this step was scheduled
                # finished on the token that step sampled; it sits in the waiting queue.
                kept = set(map(id, self.running))
                for request in finished:
                    if id(request) not in kept:
                        self.waiting.remove(request)
            self.running = running
            for request in finished:
                self._free_request(request)
        return EngineCoreOutputs(outputs=outputs, timestamp=time.time(), scheduler_stats=self.make_stats())

    def _check_stop(self, request: Request) -> bool:
        """Set a finished status on `request` if its last token ends it."""
        params = request.sampling_params
        output_token_ids = request.output_token_ids
        num_output_tokens = len(output_token_ids)
        token_id = output_token_ids[-1]
        if token_id in params.all_stop_token_ids and num_output_tokens >= params.min_tokens:
            is_eos = token_id == params.eos_token_id
            if not (is_eos and params.ignore_eos and token_id not in params.stop_token_ids):
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = None if is_eos else token_id
                return True
        if num_output_tokens >= request.max_tokens or len(request.all_token_ids) >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def _free_request(self, request: Request) -> None:
        if request.needs_sync:
            self.num_sync_requests -= 1
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def make_stats(self) -> SchedulerStats:
        """Current gauges and cumulative counters (see `SchedulerStats`)."""
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage,
            num_preemptions=self.num_preemptions,
            num_chunked_prefill_steps=self.num_chunked_prefill_steps,
            max_num_running_reqs=self.max_num_running_reqs,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_steps=self.num_steps,
        )
