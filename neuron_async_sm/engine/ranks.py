"""Starting the ranks: one device runtime per tensor-parallel rank, on the chosen executor backend.

`tensor_parallel_size=1` is the single device the engine always had. Above 1, every rank is its own
device process holding its shard (`model/parallel.py`); the ranks rendezvous on a free localhost port
and form a gloo process group among themselves, so they are started together: each one's startup
blocks until all of them have joined.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from neuron_async_sm.config import EngineConfig
from neuron_async_sm.errors import NeuronAsyncSMError
from neuron_async_sm.model.parallel import TensorParallelGroup
from neuron_async_sm.runtime import (
    DeviceRuntime,
    ProgramFactory,
    RuntimeFactory,
    WarmupCall,
    create_runtime,
)

COLLECTIVE_TIMEOUT_S = 600.0
"""Bound on the rendezvous and each collective when the device watchdog is off (device_timeout_s=0)."""


class RankStartupError(NeuronAsyncSMError, RuntimeError):
    """A tensor-parallel rank's device did not start; names the rank."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (rank 0 binds it moments later; a collision fails the rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def collective_timeout_s(config: EngineConfig) -> float:
    """The group's timeout: the device watchdog's bound, so a collective waits no longer than a program may."""
    return config.device_timeout_s if config.device_timeout_s > 0 else COLLECTIVE_TIMEOUT_S


def start_ranks(
    config: EngineConfig,
    factory_for: Callable[[TensorParallelGroup | None], ProgramFactory],
    warmup: Sequence[WarmupCall] = (),
    runtime_factory: RuntimeFactory = create_runtime,
) -> list[DeviceRuntime]:
    """One runtime per rank, rank 0 first; `factory_for(group)` builds a rank's program factory.

    All ranks start at once (their rendezvous needs every one of them). If any fails, the others
    are closed and the error names the failed rank.
    """
    size = config.tensor_parallel_size
    if config.distributed_executor_backend == "ray":
        return _start_ray_ranks(config, factory_for)
    if size == 1:
        return [start_rank(config, factory_for(None), warmup, runtime_factory)]
    port = free_port()
    groups = [TensorParallelGroup(rank, size, port, collective_timeout_s(config)) for rank in range(size)]
    return _together(
        [lambda group=group: start_rank(config, factory_for(group), warmup, runtime_factory) for group in groups]
    )


def _together(starts: list[Callable[[], DeviceRuntime]]) -> list[DeviceRuntime]:
    """Run every rank's start at once; if any fails, kill the ones that started and name the rank."""
    with ThreadPoolExecutor(max_workers=len(starts), thread_name_prefix="neuron-rank-start") as pool:
        futures = [pool.submit(start) for start in starts]
        errors = [future.exception() for future in futures]
    runtimes = [future.result() for future, error in zip(futures, errors, strict=True) if error is None]
    failed = [(rank, error) for rank, error in enumerate(errors) if error is not None]
    if failed:
        for runtime in runtimes:
            runtime.kill()
        rank, error = failed[0]
        raise RankStartupError(f"tensor-parallel rank {rank} of {len(starts)} did not start: {error}") from error
    return runtimes


def ray_init(num_cpus: int) -> None:
    """Join the Ray cluster at RAY_ADDRESS, or start a local instance of `num_cpus` CPUs, no dashboard.

    Once per process: a later engine reuses the connection. Read at the edge, at engine start-up.
    """
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING)


def _start_ray_ranks(
    config: EngineConfig, factory_for: Callable[[TensorParallelGroup | None], ProgramFactory]
) -> list[DeviceRuntime]:
    """Each rank's device is a Ray actor in one placement group; the host drives it over TCP."""
    from neuron_async_sm.runtime.host_runtime import HostRuntime
    from neuron_async_sm.runtime.ray_channel import RayChannel, RayGang

    size = config.tensor_parallel_size
    ray_init(num_cpus=os.cpu_count() or size)
    import ray

    timeout = collective_timeout_s(config)
    gang = RayGang(size, ready_timeout_s=timeout)
    actors = [gang.actor(rank) for rank in range(size)]
    groups: list[TensorParallelGroup | None] = [None]
    if size > 1:
        host, _ = ray.get(actors[0].describe.remote(), timeout=timeout)
        port = ray.get(actors[0].free_port.remote(), timeout=timeout)  # free on rank 0's node, not ours
        groups = [TensorParallelGroup(rank, size, port, timeout, host=host) for rank in range(size)]

    def start(rank: int) -> DeviceRuntime:  # device 'cpu' (the process backend): EngineConfig requires it for Ray
        channel = RayChannel(
            gang, actors[rank], factory_for(groups[rank]), config.device_time_ms, config.device_threads
        )
        return HostRuntime(channel, config)

    try:
        return _together([lambda rank=rank: start(rank) for rank in range(size)])
    except BaseException:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        raise


def start_rank(
    config: EngineConfig,
    factory: ProgramFactory,
    warmup: Sequence[WarmupCall] = (),
    runtime_factory: RuntimeFactory = create_runtime,
) -> DeviceRuntime:
    """One rank's device runtime (`factory` builds its programs; with a group, its shard), started from
    `config`'s runtime settings. Starting a rank of a group blocks until every rank of it has joined."""
    return runtime_factory(config, factory, warmup)  # warm-up: compiling devices only
