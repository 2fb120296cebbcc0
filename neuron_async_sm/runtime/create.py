"""``create_runtime``: the one entry point that picks a backend."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from neuron_async_sm.config import EngineConfig

from .api import DeviceRuntime, ProgramFactory, WarmupCall
from .config import DeviceKind, RuntimeConfig
from .host_runtime import HostRuntime
from .transport import HostChannel, ProcessChannel, ThreadChannel

RuntimeFactory = Callable[..., DeviceRuntime]
"""What builds an engine's runtime, called like ``create_runtime`` (device, programs, keyword settings).

The engine's seam for a runtime it does not pick itself: ``EngineCore(config, runtime_factory=...)``
(``LLM(..., runtime_factory=...)``). The default is ``create_runtime``; the fault tests pass one that
wraps the backend (tests/support/faulty_runtime.py).
"""


def create_runtime(
    device: str,
    programs: ProgramFactory,
    *,
    queue_depth: int = 32,
    device_time_ms: float = 0.0,
    num_threads: int = 1,
    warmup: Sequence[WarmupCall] = (),
    device_cpu: int | None = None,
    device_timeout_s: float = 120.0,
    device_startup_timeout_s: float = 600.0,
) -> DeviceRuntime:
    """Start a device and block until its programs are built.

    ``device="cpu"``: the emulated Neuron device in a spawned process (startup
    ~1-2 s, the cost of importing torch there; ``programs`` must be picklable).
    ``device="cpu-inprocess"``: the same device loop on a thread of this
    process, for fast unit tests; it shares the GIL with the host, and
    ``num_threads`` is ignored (it would change this process's torch threads).
    ``device_cpu`` (process backend): the CPU the device process is pinned to;
    the runtime's receiver thread keeps off it (see ``keep_off_cpu``).
    ``device="xla"`` (``xla_runtime.py``), ``"accelerator"`` / ``"cuda"``
    (``accelerator_runtime.py``): a real device driven from this process; the
    ``warmup`` calls run once at start-up so that serving never compiles.
    ``device_timeout_s``: a device that completes nothing for this long while work is in flight
    is declared hung: killed (a device thread is abandoned), every waiter gets ``DeviceHungError``.
    0 disables the watchdog. ``device_startup_timeout_s``: a device not ready this long after it was
    started is killed and ``DeviceStartupError`` names the limit (0: start-up may wait forever; a
    device thread cannot be killed, so ``cpu-inprocess`` start-up is not bounded).

    The settings are `EngineConfig`'s runtime fields, validated there (the one place): an unknown
    device or a bad setting raises ``ConfigError`` naming the `EngineConfig` field (``queue_depth``
    is ``runtime_queue_depth``, ``num_threads`` is ``device_threads``, the others keep their names).
    ``DeviceStartupError`` (with the device-side traceback) if ``programs()`` raises.
    """
    settings = EngineConfig(
        device=device,
        runtime_queue_depth=queue_depth,
        device_time_ms=device_time_ms,
        device_threads=num_threads,
        device_cpu=device_cpu,
        device_timeout_s=device_timeout_s,
        device_startup_timeout_s=device_startup_timeout_s,
    )
    return create_runtime_from_config(RuntimeConfig.of(settings), programs, warmup)


def create_runtime_from_config(
    config: RuntimeConfig, programs: ProgramFactory, warmup: Sequence[WarmupCall] = ()
) -> DeviceRuntime:
    """``create_runtime`` for callers that already hold a ``RuntimeConfig`` (``RuntimeConfig.of(engine_config)``)."""
    # Real devices are imported lazily: an environment without torch_xla never imports it.
    if config.device is DeviceKind.XLA:
        from .xla_runtime import create_xla_runtime

        return create_xla_runtime(programs, config, warmup)
    if config.device in (DeviceKind.ACCELERATOR, DeviceKind.CUDA):
        from .accelerator_runtime import create_accelerator_runtime

        return create_accelerator_runtime(programs, config, warmup)
    channel: HostChannel
    if config.device is DeviceKind.PROCESS:
        channel = ProcessChannel(programs, config.device_time_ms, config.num_threads, config.device_cpu)
    else:
        channel = ThreadChannel(programs, config.device_time_ms)
    return HostRuntime(channel, config)
