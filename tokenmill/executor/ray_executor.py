"""RayDistributedExecutor: ranks as Ray actors, so one model can span the hosts of a Ray cluster.

A placement group reserves one bundle per rank ({"GPU": 1} on CUDA,
{"CPU": 1} on CPU); actor i runs in bundle i and is rank i. Rank 0's
actor reports its host address and a free port, which become the
torch.distributed rendezvous (NCCL / gloo); from then on the ranks talk
to each other directly and Ray only carries each step's SchedulerOutput
(put once into the object store) and the output rank's result.

Cluster set-up is Ray's own: `ray start --head` on one host,
`ray start --address=HEAD_IP:6379` on the others, then run tokenmill on
any of them (it joins the running cluster; RAY_ADDRESS picks another).
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from tokenmill import envs
from tokenmill.config.configs import EngineConfig
from tokenmill.executor.abstract import DistributedExecutor, output_rank

logger = logging.getLogger(__name__)

_PLACEMENT_TIMEOUT_S = 120.0


class RayWorkerWrapper:
    """The body of one Ray actor: builds a Worker and runs its methods on request."""

    def __init__(self) -> None:
        self.worker: Any = None
        self.rank = 0
        self.output_rank = 0

    def get_node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def get_free_port(self) -> int:
        from tokenmill.distributed.init import get_open_port

        return get_open_port()

    def init_worker(self, engine_config: EngineConfig, rank: int, init_method: str) -> None:
        """Join the process group, pick the device Ray assigned (cuda:0 of its view) and load the model."""
        from tokenmill.distributed.init import set_nccl_env_defaults
        from tokenmill.worker.worker import Worker

        if engine_config.device_config.device == "cuda":
            set_nccl_env_defaults()
        self.rank = rank
        self.output_rank = output_rank(engine_config.parallel_config)
        # Ray sets CUDA_VISIBLE_DEVICES to the actor's GPU, so it is local device 0.
        self.worker = Worker(engine_config, rank=rank, local_rank=0, distributed_init_method=init_method)
        self.worker.init_device()
        self.worker.load_model()

    def execute_method(self, method: str, *args: Any) -> Any:
        result = getattr(self.worker, method)(*args)
        if method == "execute_model" and self.rank != self.output_rank:
            return None  # only the output rank's result is used
        return result


_HOW_TO_START = ("Start one with `ray start --head` on the head host (and `ray start --address=HEAD_IP:6379` on "
                 "each other host), then set RAY_ADDRESS=HEAD_IP:6379, or unset RAY_ADDRESS to run a local Ray "
                 "instance.")


def check_ray_address(address: str | None, timeout_s: float = 5.0) -> None:
    """Fail fast when a `host:port` Ray address does not accept connections.

    Ray itself retries an unreachable address for minutes; a plain TCP
    connect answers in `timeout_s`. None and "auto" (find a local cluster)
    are not checked.

    Raises:
        ValueError: the address is malformed or nothing listens there.
    """
    if address is None or address in ("auto", "local"):
        return
    host_port = address.split("://", 1)[-1]
    host, sep, port = host_port.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"Ray address {address!r} is not HOST:PORT (e.g. 10.0.0.1:6379). {_HOW_TO_START}")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ValueError(f"No Ray cluster answers at {address} ({e.strerror or e}). {_HOW_TO_START}") from None


def _ray_init() -> None:
    """Join the running Ray cluster (RAY_ADDRESS or this host's), or start a local one.

    Raises:
        ValueError: the address does not answer; says how to start a cluster.
    """
    import ray

    if ray.is_initialized():
        return
    address = envs.ray_address()
    check_ray_address(address)
    try:
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=True)
    except Exception as e:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ...
        raise ValueError(f"Could not connect to the Ray cluster at {address or 'this host'} "
                         f"({type(e).__name__}: {e}). {_HOW_TO_START}") from e


class RayDistributedExecutor(DistributedExecutor):
    """`world_size` Ray actors in one placement group.

    Raises:
        ValueError: Ray is unreachable, or the cluster lacks the CPUs/GPUs
            for one bundle per rank (the message gives the counts).
    """

    def __init__(self, engine_config: EngineConfig) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        super().__init__(engine_config)
        _ray_init()
        pc = engine_config.parallel_config
        on_cuda = engine_config.device_config.device == "cuda"
        resource = "GPU" if on_cuda else "CPU"
        self.pg = placement_group([{resource: 1}] * self.world_size, strategy="PACK")
        self._remove_pg = remove_placement_group
        ready, _ = ray.wait([self.pg.ready()], timeout=_PLACEMENT_TIMEOUT_S)
        if not ready:
            have = ray.cluster_resources().get(resource, 0)
            remove_placement_group(self.pg)
            raise ValueError(f"The Ray cluster cannot place {self.world_size} ranks of 1 {resource} each (it has "
                             f"{have:g} {resource}s in all); add hosts with `ray start --address=...` or lower "
                             "--tensor-parallel-size / --pipeline-parallel-size.")
        actor_cls = ray.remote(RayWorkerWrapper)
        self.actors = [
            actor_cls.options(
                num_cpus=0 if on_cuda else 1,
                num_gpus=1 if on_cuda else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
            ).remote()
            for i in range(self.world_size)
        ]
        ip = ray.get(self.actors[0].get_node_ip.remote())
        port = ray.get(self.actors[0].get_free_port.remote())
        init_method = f"tcp://{ip}:{port}"
        try:
            ray.get([a.init_worker.remote(engine_config, rank, init_method) for rank, a in enumerate(self.actors)])
        except ray.exceptions.RayTaskError as e:
            self.shutdown()
            if isinstance(getattr(e, "cause", None), ValueError):
                raise ValueError(str(e.cause)) from None
            raise
        logger.info("Started %d Ray workers (tp=%d, pp=%d), rendezvous %s", self.world_size,
                    pc.tensor_parallel_size, pc.pipeline_parallel_size, init_method)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call `execute_method` on every actor and wait for all results."""
        import ray

        if not self.actors:
            raise RuntimeError("The executor was shut down.")
        refs = [ray.put(a) for a in args]  # serialized once, shared by every actor
        return ray.get([actor.execute_method.remote(method, *refs) for actor in self.actors])

    def shutdown(self) -> None:
        import ray

        for actor in getattr(self, "actors", []):
            ray.kill(actor)
        self.actors = []
        if getattr(self, "pg", None) is not None:
            self._remove_pg(self.pg)
            self.pg = None
