"""EngineCore: the executor (model + KV cache) and the Scheduler, stepped together.

    add_request ──> Scheduler.waiting
    step():  schedule() ──SchedulerOutput──> executor.execute_model()
             update_from_output() <──ModelRunnerOutput──┘  -> EngineCoreOutputs

With async scheduling (`--async-scheduling`, on by default for one GPU) a
step launches step N+1 before it waits for step N's sampled ids:

    step():  schedule(N+1) -> executor.execute_model_async(N+1)   (GPU queue: N, N+1)
             wait for N -> update_from_output(N) -> EngineCoreOutputs of N

so the host's scheduling, input preparation and output processing overlap
the GPU's work. While any request needs its outputs on the host before its
next step can be built (`Scheduler.num_sync_requests`: penalties,
min_tokens, structured output), steps run synchronously.

Used in-process by `LLMEngine` and in its own process by the server
(`engine/core_proc.py`). It sees token ids only, never text.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from tokenmill.config.configs import EngineConfig, kv_memory_hint
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from tokenmill.structured_output.manager import StructuredOutputManager

if TYPE_CHECKING:
    from tokenmill.executor.abstract import Executor

logger = logging.getLogger(__name__)

def kv_cache_bytes_per_block(engine_config: EngineConfig) -> int:
    """Bytes one KV block takes over all layers of the whole model (K and V), for the start-up log and the
    CPU memory check.

    The formula is `worker.kv_cache.kv_bytes_per_block`, over the unsplit model
    (every layer, every KV head). Raises ValueError for an unknown dtype name.
    """
    from tokenmill.dtypes import kv_cache_dtype
    from tokenmill.worker.kv_cache import kv_bytes_per_block

    mc = engine_config.model_config
    hf = mc.hf_config
    num_heads = int(getattr(hf, "num_attention_heads", 1))
    num_kv_heads = int(getattr(hf, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(hf, "head_dim", None) or int(hf.hidden_size) // num_heads)
    num_layers = int(getattr(hf, "num_hidden_layers", 1))
    if engine_config.cache_config.sliding_window_group is not None:
        num_layers //= 2  # the two groups' layers share tensors pairwise (worker/kv_cache.py)
    kv_dtype = kv_cache_dtype(engine_config.cache_config.cache_dtype, mc.dtype)
    return kv_bytes_per_block(num_layers, engine_config.cache_config.block_size, num_kv_heads, head_dim, kv_dtype)


def _check_kv_bytes_before_loading(engine_config: EngineConfig) -> None:
    """An explicit --kv-cache-memory-bytes too small for one max_model_len sequence, or on CPU larger than the
    memory available, fails here, before the model loads, with the message the workers would give after loading.

    The busiest worker holds at least 1 / (tensor x pipeline parallel size) of a block (its share of the KV heads
    and layers), so the blocks counted here are at least as many as the engine gets: the check never refuses
    what would run.

    Raises:
        ValueError: naming the largest max_model_len that fits and the flags that help, or both memory sizes.
    """
    from tokenmill.worker.kv_cache import check_max_model_len_fits

    cache, sched = engine_config.cache_config, engine_config.scheduler_config
    per_block = kv_cache_bytes_per_block(engine_config) / max(engine_config.parallel_config.world_size, 1)
    num_blocks = int(cache.kv_cache_memory_bytes // per_block)
    hint = kv_memory_hint(cache, engine_config.device_config.device)
    if num_blocks < 1:
        raise ValueError(f"--kv-cache-memory-bytes {cache.kv_cache_memory_bytes} is smaller than one KV block of this "
                         f"model ({per_block / 2**20:.2f} MiB); raise it.")
    check_max_model_len_fits(num_blocks, cache.block_size, sched.max_model_len, hint, cache.sliding_window_group,
                             sched.max_num_batched_tokens)
    # Also after loading (EngineCore.__init__), when the weights no longer count as available.
    _check_cpu_kv_fits(engine_config, cache.kv_cache_memory_bytes * engine_config.parallel_config.world_size)


def _check_cpu_kv_fits(engine_config: EngineConfig, total_bytes: int) -> None:
    """On CPU, refuse KV caches of `total_bytes` (all workers) that this host's available memory cannot hold
    (`platforms.memory.check_cpu_kv_cache_fits`: they are committed lazily, so they would fail under load).
    Not under Ray, whose workers may sit on other hosts."""
    parallel = engine_config.parallel_config
    if engine_config.device_config.device != "cpu" or parallel.distributed_executor_backend == "ray":
        return
    from tokenmill.platforms.memory import check_cpu_kv_cache_fits, host_available_bytes

    check_cpu_kv_cache_fits(total_bytes, host_available_bytes())


def _executor_class(engine_config: EngineConfig) -> type[Executor]:
    from tokenmill.executor import get_executor_class

    return get_executor_class(engine_config.parallel_config)


class EngineCore:
    """Scheduler + executor for one engine.

    Args:
        engine_config: the resolved `EngineConfig`; `cache_config.num_gpu_blocks`
            is filled here.
        executor_class: override the executor (tests pass a fake one).

    Raises:
        ValueError: the KV cache cannot hold one max_model_len sequence.
    """

    def __init__(self, engine_config: EngineConfig, executor_class: type[Executor] | None = None) -> None:
        self.engine_config = engine_config
        cache = engine_config.cache_config
        sched_cfg = engine_config.scheduler_config
        if cache.kv_cache_memory_bytes is not None and cache.num_gpu_blocks_override is None:
            _check_kv_bytes_before_loading(engine_config)
        self.executor = (executor_class or _executor_class(engine_config))(engine_config)
        num_blocks = int(cache.num_gpu_blocks_override or self.executor.determine_num_available_blocks())
        if num_blocks <= 0:
            raise ValueError("No memory is left for the KV cache after loading the model; give it more memory "
                             "(--kv-cache-memory-bytes / --gpu-memory-utilization) or use a smaller model.")
        max_model_len = sched_cfg.max_model_len
        self._log_kv_cache(num_blocks, cache.block_size, max_model_len)
        from tokenmill.worker.kv_cache import check_max_model_len_fits

        check_max_model_len_fits(num_blocks, cache.block_size, max_model_len,
                                 kv_memory_hint(cache, engine_config.device_config.device),
                                 cache.sliding_window_group, sched_cfg.max_num_batched_tokens)
        # Weights are loaded by now, so the available memory excludes them; the blocks x whole-model block
        # bytes are every worker's caches together.
        _check_cpu_kv_fits(engine_config, num_blocks * kv_cache_bytes_per_block(engine_config))
        self.executor.initialize_kv_cache(num_blocks)
        cache.num_gpu_blocks = num_blocks
        if sched_cfg.async_scheduling and not self.executor.supports_async:
            logger.info("async scheduling off: the executor runs steps synchronously")
            sched_cfg.async_scheduling = False
        self.scheduler = Scheduler(sched_cfg, cache, num_blocks)
        # Async scheduling: (scheduler output, handle) of the step launched but not yet read back.
        self._pending: tuple[Any, Any] | None = None
        # Outputs of a step read back early (a request id reused while its old request was in flight).
        self._deferred: list[EngineCoreOutputs] = []
        # Grammar compile + per-request matchers + each step's bitmask (structured output).
        self.structured_output = StructuredOutputManager(engine_config)

    def _log_kv_cache(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        from tokenmill.dtypes import dtype_name
        from tokenmill.dtypes import kv_cache_dtype
        from tokenmill.worker.kv_cache import blocks_per_sequence

        tokens = num_blocks * block_size
        gib = num_blocks * kv_cache_bytes_per_block(self.engine_config) / 2**30
        kv_dtype = dtype_name(kv_cache_dtype(self.engine_config.cache_config.cache_dtype,
                                               self.engine_config.model_config.dtype))
        window = self.engine_config.cache_config.sliding_window_group
        if window is not None:
            # Two groups: a sequence holds its full length in the full-attention group and about the window
            # in the sliding-window group, out of one pool of blocks that each cost half the layers.
            need = blocks_per_sequence(max_model_len, block_size, window,
                                       self.engine_config.scheduler_config.max_num_batched_tokens)
            logger.info("KV cache: %d blocks x %d tokens (%.2f GiB, %s) for the full-attention and the "
                        "sliding-window layers (window %d tokens); a max_model_len=%d sequence holds at most %d "
                        "blocks: max concurrency %.1fx requests (%d full-length tokens when the windows are short)",
                        num_blocks, block_size, gib, kv_dtype, window, max_model_len, need, num_blocks / need,
                        tokens * -(-max_model_len // block_size) // need)
            return
        logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %s); max concurrency at "
                    "max_model_len=%d: %.1fx requests", num_blocks, block_size, tokens, gib, kv_dtype, max_model_len,
                    tokens / max_model_len)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a processed request. `sampling_params.max_tokens` must be set (InputProcessor does it).

        Raises:
            ValueError: duplicate id, or a prompt the scheduler refuses.
        """
        if self._pending is not None and request.request_id in self._pending[0].num_scheduled_tokens:
            # The id's previous request (finished or aborted) is in the step in flight: read that step back
            # first, or its token would be taken for the new request's. Its outputs go out with the next step.
            self._deferred.append(self._finish_pending())
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is None:
            max_tokens = self.engine_config.scheduler_config.max_model_len - len(request.prompt_token_ids)
        req = Request(request, max_tokens)
        spec = self.structured_output.spec_of(req)
        if spec is not None:  # held back until its grammar is compiled (off the step thread)
            self.structured_output.submit(req, spec)
            return
        self.scheduler.add_request(req)

    def abort_requests(self, request_ids: list[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Finish requests early and free their blocks (unknown ids are ignored).

        `status` is FINISHED_ABORTED for aborts, FINISHED_STOPPED when a stop
        string matched in the output processor.
        """
        if request_ids:
            self.structured_output.abort(request_ids)
            self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.structured_output.has_pending()

    def step(self) -> EngineCoreOutputs:
        """Run one scheduling step; empty outputs when nothing could be scheduled.

        Async scheduling: the outputs returned are those of the step launched
        by the previous call (this call launches the next one first).
        """
        deferred, self._deferred = self._deferred, []
        outputs = self._step()
        if deferred:  # older than this step's: first
            outputs.outputs[:0] = [o for d in deferred for o in d.outputs]
        return outputs

    def _step(self) -> EngineCoreOutputs:
        so_failed = self._admit_structured_requests()
        if self.scheduler.async_scheduling:
            if self.scheduler.num_sync_requests == 0:
                return self._step_async(so_failed)
            if self._pending is not None:  # finish the step in flight before a synchronous one
                outputs = self._finish_pending()
                outputs.outputs.extend(so_failed)
                return outputs
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.total_num_scheduled_tokens == 0:
            return EngineCoreOutputs(outputs=so_failed, scheduler_stats=self.scheduler.make_stats())
        self.structured_output.fill_bitmask(scheduler_output)
        model_output = self.executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        self.structured_output.accept_outputs(outputs, self.scheduler)
        outputs.outputs.extend(so_failed)
        return outputs

    def _step_async(self, so_failed: list[EngineCoreOutput]) -> EngineCoreOutputs:
        """Launch the next step, then read back and apply the one launched by the previous call."""
        scheduler_output = self.scheduler.schedule()
        launched = None
        if scheduler_output.total_num_scheduled_tokens > 0:
            launched = (scheduler_output, self.executor.execute_model_async(scheduler_output))
        if self._pending is not None:
            outputs = self._finish_pending()
        else:
            outputs = EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats())
        self._pending = launched
        outputs.outputs.extend(so_failed)
        return outputs

    def _finish_pending(self) -> EngineCoreOutputs:
        """Wait for the step in flight and apply its sampled tokens."""
        assert self._pending is not None
        scheduler_output, handle = self._pending
        self._pending = None
        outputs = self.scheduler.update_from_output(scheduler_output, handle.result())
        self.structured_output.accept_outputs(outputs, self.scheduler)
        return outputs

    def _admit_structured_requests(self) -> list[EngineCoreOutput]:
        """Hand requests whose grammar compiled to the scheduler; outputs for those that failed."""
        if not self.structured_output.has_pending():
            return []
        ready, failed = self.structured_output.pop_ready(wait=not self.scheduler.has_unfinished_requests())
        for req in ready:
            try:
                self.scheduler.add_request(req)
            except ValueError as exc:
                logger.error("request %s refused by the scheduler: %s", req.request_id, exc)
                self.structured_output.abort([req.request_id])
                failed.append(EngineCoreOutput(request_id=req.request_id, new_token_ids=[],
                                               finish_reason=FinishReason.ABORT))
        return failed

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def shutdown(self) -> None:
        # A step still in flight holds the model runner (and through it the KV cache); drop it.
        self._pending = None
        self.structured_output.shutdown()
        shutdown = getattr(self.executor, "shutdown", None)
        if shutdown is not None:
            shutdown()
