"""Worker: one device's process-side wrapper around the ModelRunner."""

from __future__ import annotations

import logging
import os

import torch

from tokenmill import envs
from tokenmill.config.configs import EngineConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.worker.cpu_threads import CpuThreadGovernor
from tokenmill.worker.model_runner import AsyncModelRunnerOutput, ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    """Owns the device, the model and its KV cache for one rank.

    Args:
        engine_config: the resolved engine configuration.
        rank: global rank (tensor-parallel rank on one node).
        local_rank: device index on this host (CUDA).
        distributed_init_method: torch.distributed init URL (e.g.
            "tcp://127.0.0.1:29500"); needed when world_size > 1.
    """

    def __init__(
        self, engine_config: EngineConfig, rank: int = 0, local_rank: int = 0, distributed_init_method: str | None = None
    ) -> None:
        self.config = engine_config
        self.rank = rank
        self.local_rank = local_rank
        self.distributed_init_method = distributed_init_method
        self.device: torch.device | None = None
        self.model_runner: ModelRunner | None = None
        self.cpu_threads: CpuThreadGovernor | None = None  # CPU, one rank: threads follow the free cores

    def init_device(self) -> None:
        """Pick the device, join the process group when tensor-parallel, seed torch.

        CPU threads: env TOKENMILL_CPU_THREADS if set, else with several ranks
        max(1, cores // world_size) each so ranks do not oversubscribe the host.
        CPU: glibc malloc keeps freed activation memory (`platforms.cpu.tune_malloc`).

        Raises:
            ValueError: world_size > 1 without a distributed_init_method.
        """
        dc, pc = self.config.device_config, self.config.parallel_config
        if dc.device == "cuda":
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
            from tokenmill.platforms.cuda import prepare_cuda_device

            prepare_cuda_device(self.local_rank, dc.force_cc70)  # torch arch check; SDPA limits on cc < 8.0
            if pc.world_size > 1 and envs.omp_num_threads() is None:
                # Rank processes on one host would each start a full OpenMP pool and
                # spin against each other in the step's small CPU-side tensor ops
                # (vLLM's workers use one thread for the same reason).
                torch.set_num_threads(1)
        else:
            self.device = torch.device("cpu")
            from tokenmill.platforms.cpu import tune_malloc

            if tune_malloc():
                logger.debug("glibc malloc tuned for CPU inference (TOKENMILL_CPU_MALLOC_TUNING=0 turns it off)")
            threads = envs.cpu_threads()
            if threads:
                torch.set_num_threads(threads)
            elif pc.world_size > 1:
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // pc.world_size))
            if pc.world_size == 1 and envs.cpu_adaptive_threads():
                self.cpu_threads = CpuThreadGovernor(torch.get_num_threads())
        if pc.world_size > 1:
            self._init_distributed(pc.world_size)
        torch.manual_seed(self.config.model_config.seed)
        self.model_runner = ModelRunner(self.config, self.device, pc.tensor_parallel_size)

    def _init_distributed(self, world_size: int) -> None:
        from tokenmill.distributed.init import init_distributed

        if self.distributed_init_method is None:
            raise ValueError("A tensor-parallel worker needs a distributed_init_method (e.g. tcp://127.0.0.1:PORT).")
        assert self.device is not None
        pc = self.config.parallel_config
        init_distributed(self.distributed_init_method, self.rank, pc.tensor_parallel_size,
                         pc.pipeline_parallel_size, self.device)

    def load_model(self) -> None:
        self._runner().load_model()

    def determine_num_available_blocks(self) -> int:
        return self._runner().determine_num_available_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._runner().initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.cpu_threads is None:
            return self._runner().execute_model(scheduler_output)
        self.cpu_threads.step()
        try:
            return self._runner().execute_model(scheduler_output)
        finally:
            self.cpu_threads.step_done()

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        if self.cpu_threads is None:
            return self._runner().execute_model_async(scheduler_output)
        self.cpu_threads.step()
        try:
            return self._runner().execute_model_async(scheduler_output)  # on CPU the step has run when this returns
        finally:
            self.cpu_threads.step_done()

    def _runner(self) -> ModelRunner:
        assert self.model_runner is not None, "init_device() first"
        return self.model_runner
