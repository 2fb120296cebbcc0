"""``create_runtime``: the one entry point that picks a backend."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from neuron_async_sm.config import EngineConfig

from .api import DeviceRuntime, ProgramFactory, WarmupCall
from .devices import DeviceKind
from .host_runtime import HostRuntime
from .transport import HostChannel, ProcessChannel, ThreadChannel

RuntimeFactory = Callable[[EngineConfig, ProgramFactory, Sequence[WarmupCall]], DeviceRuntime]
"""What builds an engine's runtime, called like ``create_runtime`` (config, programs, warm-up calls).

The engine's seam for a runtime it does not pick itself: ``EngineCore(config, runtime_factory=...)``
(``LLM(..., runtime_factory=...)``). The default is ``create_runtime``; the fault tests pass one that
wraps the backend (tests/support/faulty_runtime.py).
"""


def create_runtime(config: EngineConfig, programs: ProgramFactory, warmup: Sequence[WarmupCall] = ()) -> DeviceRuntime:
    """Start ``config.device`` and block until its programs are built.

    The runtime reads its settings from the `EngineConfig`, by their field names (validated there,
    the one place): ``device``, ``runtime_queue_depth``, ``device_time_ms``, ``device_threads``,
    ``device_cpu``, ``device_timeout_s``, ``device_startup_timeout_s``; the other fields are the
    engine's.

    ``device="cpu"``: the emulated Neuron device in a spawned process (startup
    ~1-2 s, the cost of importing torch there; ``programs`` must be picklable).
    ``device="cpu-inprocess"``: the same device loop on a thread of this
    process, for fast unit tests; it shares the GIL with the host, and
    ``device_threads`` is ignored (it would change this process's torch threads).
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

    ``DeviceStartupError`` (with the device-side traceback) if ``programs()`` raises.
    """
    device = DeviceKind(config.device)
    # Real devices are imported lazily: an environment without torch_xla never imports it.
    if device is DeviceKind.XLA:
        from .xla_runtime import create_xla_runtime

        return create_xla_runtime(programs, config, warmup)
    if device in (DeviceKind.ACCELERATOR, DeviceKind.CUDA):
        from .accelerator_runtime import create_accelerator_runtime

        return create_accelerator_runtime(programs, config, warmup)
    channel: HostChannel
    if device is DeviceKind.PROCESS:
        channel = ProcessChannel(programs, config.device_time_ms, config.device_threads, config.device_cpu)
    else:
        channel = ThreadChannel(programs, config.device_time_ms)
    return HostRuntime(channel, config)
