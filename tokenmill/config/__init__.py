"""Engine configuration.

    args.py     EngineArgs: what the user passes (CLI flags, `LLM(...)` kwargs)
    configs.py  the resolved configs (plain data; imports nothing from tokenmill)
    resolve.py  EngineArgs -> EngineConfig; the only module here that imports
                downward (model loader, platforms, executor), loaded lazily by
                `EngineArgs.create_engine_config`

Lower layers import `tokenmill.config.configs`; this package re-exports the
plain data and `EngineArgs` for callers above them, never `resolve`.
"""

from tokenmill.config.args import EngineArgs
from tokenmill.config.configs import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    kv_memory_hint,
    parse_size,
)

__all__ = [
    "CacheConfig",
    "DeviceConfig",
    "EngineArgs",
    "EngineConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "kv_memory_hint",
    "parse_size",
]
