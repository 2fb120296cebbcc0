"""Device runtime with Neuron async-execution semantics.

Programs are enqueued and return futures at once; they run in order on the
device; a future can feed a later program without visiting the host; reading
one to the host blocks. See ``api.py`` for the protocol the worker codes
against and ``create_runtime`` for the emulated backends.
"""

from .api import DeviceFuture, DeviceRuntime, Program, ProgramFactory, RuntimeStats, TensorSpec, WarmupCall
from .create import RuntimeFactory, create_runtime
from .devices import DeviceKind, keep_off_cpu
from .errors import DeviceHungError, DeviceLostError, DeviceProgramError, DeviceStartupError
from .messages import WireTensor

__all__ = [
    "DeviceFuture",
    "DeviceHungError",
    "DeviceKind",
    "DeviceLostError",
    "DeviceProgramError",
    "DeviceRuntime",
    "DeviceStartupError",
    "Program",
    "ProgramFactory",
    "RuntimeFactory",
    "RuntimeStats",
    "TensorSpec",
    "WarmupCall",
    "WireTensor",
    "create_runtime",
    "keep_off_cpu",
]
