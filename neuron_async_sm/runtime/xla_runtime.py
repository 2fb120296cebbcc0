"""``--device xla``: PyTorch/XLA through PJRT (the CPU client here; Neuron's plugin with PJRT_DEVICE=NEURON).

How the protocol maps onto XLA:

- enqueue: the program is traced on the calling thread (lazy tensors, nothing runs), then
  ``torch_xla.sync()`` compiles the graph if its shapes are new (blocking, once per shape: the
  warm-up does it for every bucket) and dispatches it; it returns while the device runs.
- a future is the program's un-materialized output tensor; fed to a later program it is a graph
  parameter that stays in device memory (device to device).
- done: PJRT's ready callback on the output buffer (``_on_ready_callback``) sets the completion event
  and frees the queue slot, so the bounded queue counts what the device has not finished.
- to_host: ``tensor.cpu()``, which blocks until the buffer exists (``HostFuture`` makes it call-once).
- failures: a program that raises while tracing never reaches the device; its future holds the error
  and dependants fail with its root cause (``LocalRuntime``). An execution error surfaces at ``.cpu()``.
- compilations: torch_xla's ``UncachedCompile`` counter, in ``stats().compilations`` (0 after warm-up).
- device state: what the program factory created on the device (the KV cache) is materialized before
  the first program (``settle``), so that no graph carries its creation.

torch_xla is imported only here, and only when this backend is created.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from neuron_async_sm.config import EngineConfig

from .api import ProgramFactory, WarmupCall
from .errors import DeviceStartupError
from .local_runtime import DeviceOps, LocalRuntime, Ready


class XlaOps(DeviceOps):
    """The XLA device of this process (``torch_xla.device()``)."""

    compiles = True

    def __init__(self) -> None:
        try:
            import torch_xla
            import torch_xla.debug.metrics as metrics
        except ImportError as exc:
            raise DeviceStartupError(
                f"--device xla needs torch_xla, which this environment lacks ({exc}); build its venv with .ci/xla-env"
            ) from exc
        self._xla = torch_xla
        self._metrics = metrics
        self.device = torch_xla.device()

    def launch(self, call: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, object]:
        out = call()  # traced: nothing has run yet
        self._xla.sync()  # compile (new shapes only) and dispatch this program's graph; returns at once
        return out, out

    def settle(self) -> None:
        # Hazard: a compile while serving. Tensors the factory created on the device (the KV cache's
        # zeros) are lazy until a sync; left so, the first program's graph would carry their creation
        # and be a graph of its own: warm-up's first call compiled it, and serving's first call of that
        # shape (cache now device data) compiled again. Materialized here, every call of a shape is one graph.
        self._xla.sync()

    def when_ready(self, token: object, ready: Ready) -> None:
        assert isinstance(token, torch.Tensor)
        self._xla._XLAC._on_ready_callback(token, lambda: ready(None))

    def to_host(self, out: torch.Tensor, token: object) -> torch.Tensor:
        return out.cpu()

    def compilations(self) -> int:
        return int(self._metrics.counter_value("UncachedCompile") or 0)


def create_xla_runtime(programs: ProgramFactory, config: EngineConfig, warmup: Sequence[WarmupCall]) -> LocalRuntime:
    return LocalRuntime(XlaOps(), programs, config, warmup)
