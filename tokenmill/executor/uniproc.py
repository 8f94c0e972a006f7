"""UniProcExecutor: one worker in this process (a single CPU or GPU)."""

from __future__ import annotations

import gc

from tokenmill.config.configs import EngineConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.executor.abstract import Executor
from tokenmill.worker.model_runner import AsyncModelRunnerOutput
from tokenmill.worker.worker import Worker


class UniProcExecutor(Executor):
    """Builds the worker, its device and its model at construction."""

    supports_async = True

    def __init__(self, engine_config: EngineConfig) -> None:
        super().__init__(engine_config)
        self.worker: Worker | None = Worker(engine_config)
        self.worker.init_device()
        self.worker.load_model()

    def determine_num_available_blocks(self) -> int:
        return self._worker().determine_num_available_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.config.cache_config.num_gpu_blocks = num_blocks
        self._worker().initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._worker().execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Launch the step; `.result()` of the returned handle waits for its sampled ids (async scheduling)."""
        return self._worker().execute_model_async(scheduler_output)

    def shutdown(self) -> None:
        if self.worker is None:
            return
        if self.worker.model_runner is not None:
            self.worker.model_runner.release()
        self.worker = None
        gc.collect()
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _worker(self) -> Worker:
        if self.worker is None:
            raise RuntimeError("The executor was shut down.")
        return self.worker
