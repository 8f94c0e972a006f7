"""Executors: what runs the workers. `get_executor_class` picks one from the parallel config."""

from __future__ import annotations

from tokenmill.config.configs import ParallelConfig

_BACKENDS = ("mp", "ray", "uni")


def get_executor_class(parallel_config: ParallelConfig) -> type:
    """The executor class for `--distributed-executor-backend` (vLLM's choices).

    None picks "uni" (in-process) for one rank and "mp" (one process per
    rank on this host) for more; "ray" places ranks as Ray actors (several
    hosts possible).

    Raises:
        ValueError: an unknown backend, "uni" with several ranks, or "ray"
            without the ray package.
    """
    backend = parallel_config.distributed_executor_backend
    world_size = parallel_config.world_size
    if backend is None:
        backend = "uni" if world_size == 1 else "mp"
    if backend not in _BACKENDS:
        raise ValueError(f"--distributed-executor-backend must be one of {', '.join(_BACKENDS)}, got {backend!r}.")
    if backend == "uni":
        if world_size > 1:
            raise ValueError(f"--distributed-executor-backend uni runs one rank, but tensor_parallel_size x "
                             f"pipeline_parallel_size = {world_size}; use mp (one host) or ray (several hosts).")
        from tokenmill.executor.uniproc import UniProcExecutor

        return UniProcExecutor
    if backend == "mp":
        from tokenmill.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor
    try:
        import ray  # noqa: F401  (only checks that it is installed)
    except ImportError as e:
        raise ValueError("--distributed-executor-backend ray needs the ray package: pip install -e '.[ray]' in the "
                         "tokenmill checkout (or pip install ray).") from e
    from tokenmill.executor.ray_executor import RayDistributedExecutor

    return RayDistributedExecutor
