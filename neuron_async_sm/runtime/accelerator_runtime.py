"""``--device accelerator`` / ``--device cuda``: PyTorch's device-generic stream API.

The device is whatever ``torch.accelerator`` reports (CUDA, or TorchNeuron's native ``neuron``
device, XPU, MPS, ...). How the protocol maps onto streams:

- enqueue: the program runs on the calling thread under the one compute stream, which only queues
  its kernels (host inputs are copied in on that stream too); an event recorded after them is the
  program's completion.
- a future is the output tensor plus that event; fed to a later program it is passed as is, and
  stream order makes the later kernels wait for it (device to device, no event wait on the host).
- done / the bounded queue: a waiter thread synchronizes the events in enqueue order and marks each
  program finished, which frees its queue slot.
- to_host: a copy stream waits for the program's event (not for programs queued after it), copies
  into pinned host memory with ``non_blocking=True``, and the host waits on an event after the copy.
- failures: a program that raises while queueing fails its future and its dependants (``LocalRuntime``);
  an asynchronous device error surfaces at the event wait or the copy.

Without an accelerator (this machine) the device is the CPU and everything runs synchronously in
``enqueue``; the protocol still holds, only nothing overlaps. ``cuda`` refuses to start unless the
accelerator is CUDA.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence

import torch

from neuron_async_sm.config import EngineConfig

from .api import ProgramFactory, WarmupCall
from .devices import DeviceKind
from .errors import DeviceStartupError
from .local_runtime import DeviceOps, LocalRuntime, Ready


class AcceleratorOps(DeviceOps):
    """One compute stream and one copy stream on the current accelerator, or the synchronous CPU."""

    def __init__(self, require: str | None) -> None:
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        if require is not None and (accelerator is None or accelerator.type != require):
            raise DeviceStartupError(f"--device {require}: torch.accelerator reports {accelerator or 'no accelerator'}")
        self._waits: queue.SimpleQueue[tuple[torch.Event, Ready] | None] = queue.SimpleQueue()
        self._waiter: threading.Thread | None = None
        if accelerator is None:
            self.device = torch.device("cpu")
            self._compute = self._copy = None
            return
        self.device = torch.device(accelerator.type, torch.accelerator.current_device_index())
        self._compute = torch.Stream(self.device)
        self._copy = torch.Stream(self.device)
        self._waiter = threading.Thread(target=self._wait_in_order, name="accelerator-waiter", daemon=True)
        self._waiter.start()

    def launch(self, call: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, object]:
        if self._compute is None:
            return call(), None  # the CPU: it ran already
        with self._compute:
            out = call()
            finished = torch.Event(self.device)
            finished.record(self._compute)
        return out, finished

    def when_ready(self, token: object, ready: Ready) -> None:
        if token is None:
            ready(None)
            return
        assert isinstance(token, torch.Event)
        self._waits.put((token, ready))

    def to_host(self, out: torch.Tensor, token: object) -> torch.Tensor:
        if self._copy is None:
            return out
        assert isinstance(token, torch.Event)
        with self._copy:
            self._copy.wait_event(token)  # this program only, not the ones queued after it
            host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            host.copy_(out, non_blocking=True)
            copied = torch.Event(self.device)
            copied.record(self._copy)
        copied.synchronize()
        return host

    def close(self) -> None:
        if self._waiter is not None:
            self._waits.put(None)
            self._waiter.join(timeout=5.0)
            self._waiter = None

    def _wait_in_order(self) -> None:
        while (item := self._waits.get()) is not None:
            event, ready = item
            try:
                event.synchronize()
            except Exception as exc:  # an asynchronous device error
                ready(f"{type(exc).__name__}: {exc}")
            else:
                ready(None)


def create_accelerator_runtime(
    programs: ProgramFactory, config: EngineConfig, warmup: Sequence[WarmupCall]
) -> LocalRuntime:
    require = "cuda" if DeviceKind(config.device) is DeviceKind.CUDA else None
    return LocalRuntime(AcceleratorOps(require), programs, config, warmup)
