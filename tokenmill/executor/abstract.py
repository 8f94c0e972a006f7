"""Executor: what the engine core drives, whatever runs the workers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

from tokenmill.config.configs import EngineConfig
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
