"""Errors raised by a device runtime.

The hierarchy lets a caller catch everything the device can do to it with one
``except DeviceProgramError`` while still telling a lost device apart:

    DeviceProgramError          a program (or a program it depends on) failed
    └── DeviceLostError         the device is gone: killed, crashed or closed
        ├── DeviceStartupError  the device never became usable (the factory failed)
        └── DeviceHungError     the device stopped making progress; the runtime killed it
"""

from __future__ import annotations

from neuron_async_sm.errors import NeuronAsyncSMError


class DeviceProgramError(NeuronAsyncSMError, RuntimeError):
    """A program failed on the device.

    The message names the program, its sequence number and the root cause; a
    program that consumed the output of a failed program carries the root
    cause of the first failure, not a chain of wrappers.
    """


class DeviceLostError(DeviceProgramError):
    """The device can no longer run programs (process died, or the runtime was closed).

    Every waiter (``to_host``, a blocked ``enqueue``) receives this instead of
    hanging; every later call raises it at once.
    """


class DeviceStartupError(DeviceLostError):
    """The device failed before it was ready, e.g. the program factory raised.

    The message carries the device-side traceback so that a model that fails
    to load explains itself on the host.
    """


class DeviceHungError(DeviceLostError):
    """The device made no progress on in-flight work for ``device_timeout_s``; the runtime killed it.

    A lost device to every handler (``except DeviceLostError``); the message says how long the
    device was silent, how much work it held, and what was done to it (killed, or abandoned).
    """
