"""Executor: what the engine core drives, whatever runs the workers.

`Executor` is the interface; `DistributedExecutor` is the shared dispatch of
the executors whose ranks live in other processes (multiproc, Ray): every
call goes to every rank (`collective_rpc`), a step's output comes from the
output rank.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

from tokenmill.config.configs import EngineConfig, ParallelConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from tokenmill.worker.model_runner import AsyncModelRunnerOutput


class Executor(ABC):
    """Runs one step on every worker and returns the driver's output.

    Construction starts the workers, initializes their devices and loads the
    model; the engine then sizes and allocates the KV cache:

        executor = SomeExecutor(config)
        n = executor.determine_num_available_blocks()   # min over workers
        executor.initialize_kv_cache(n)
        out = executor.execute_model(scheduler_output)

    An executor that can launch a step before the previous one's sampled ids
    are read (async scheduling) sets `supports_async = True` and overrides
    `execute_model_async`; the engine core turns async scheduling off for
    the others.
    """

    # True when execute_model_async is implemented (checked by EngineCore at start-up).
    supports_async: ClassVar[bool] = False

    def __init__(self, engine_config: EngineConfig) -> None:
        self.config = engine_config

    @abstractmethod
    def determine_num_available_blocks(self) -> int: ...

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Launch one step and return at once; `.result()` of the handle waits for its output.

        Raises:
            NotImplementedError: the executor has `supports_async = False`.
        """
        raise NotImplementedError(f"{type(self).__name__} runs steps synchronously (supports_async is False).")

    def shutdown(self) -> None:
        """Stop the workers and free their memory (idempotent)."""


def output_rank(parallel_config: ParallelConfig) -> int:
    """Global rank whose step result is used: tp rank 0 of the last pipeline stage.

    Ranks are numbered pp_rank * tp_size + tp_rank (as `parallel_state.get_output_rank`).
    """
    return (parallel_config.pipeline_parallel_size - 1) * parallel_config.tensor_parallel_size


class DistributedExecutor(Executor):
    """An executor of `world_size` ranks in other processes: one dispatch, the transport left to subclasses.

    A subclass starts the ranks in `__init__` (after this one) and implements
    `collective_rpc` and `shutdown`.
    """

    def __init__(self, engine_config: EngineConfig) -> None:
        super().__init__(engine_config)
        self.world_size = engine_config.parallel_config.world_size
        self.output_rank = output_rank(engine_config.parallel_config)

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Run `Worker.<method>(*args)` on every rank; their results in rank order.

        Ranks other than the output rank return None for `execute_model`.

        Raises:
            RuntimeError: the executor was shut down, or a rank failed.
        """

    def determine_num_available_blocks(self) -> int:
        """The minimum over ranks (ranks may hold different numbers of KV heads or layers)."""
        return min(self.collective_rpc("determine_num_available_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.config.cache_config.num_gpu_blocks = num_blocks
        self.collective_rpc("initialize_kv_cache", num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", scheduler_output)[self.output_rank]
