"""Executor: what the engine core drives, whatever runs the workers."""

from __future__ import annotations

from abc import ABC, abstractmethod

from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    """Runs one step on every worker and returns the driver's output.

    Construction starts the workers, initializes their devices and loads the
    model; the engine then sizes and allocates the KV cache:

        executor = SomeExecutor(config)
        n = executor.determine_num_available_blocks()   # min over workers
        executor.initialize_kv_cache(n)
        out = executor.execute_model(scheduler_output)
    """

    def __init__(self, engine_config: EngineConfig) -> None:
        self.config = engine_config

    @abstractmethod
    def determine_num_available_blocks(self) -> int: ...

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None:
        """Stop the workers and free their memory (idempotent)."""
