"""The host-side handle of a device tensor."""

from __future__ import annotations

import enum
import threading
from typing import Protocol

import torch

from .api import DeviceFuture, TensorSpec
from .errors import DeviceLostError, DeviceProgramError


class FutureOwner(Protocol):
    """What a future needs from the runtime that created it."""

    def fetch(self, future_id: int) -> torch.Tensor:
        """Transfer the value to the host; blocks; raises DeviceProgramError / DeviceLostError."""

    def release(self, future: HostFuture) -> None:
        """Free the device memory now (ordered after every program enqueued earlier)."""

    def defer_release(self, future_id: int) -> None:
        """Free the device memory with the next message; safe to call from ``__del__``."""


class HostCopy(enum.Enum):
    """What the host holds of a future's value."""

    NONE = "none"  # nothing yet: to_host must fetch
    VALUE = "value"  # the transferred tensor, cached
    ERROR = "error"  # the program's failure, cached


class HostFuture(DeviceFuture):
    """``DeviceFuture`` of the emulated runtime; the output of program ``future_id``."""

    def __init__(self, owner: FutureOwner, future_id: int, spec: TensorSpec, finished: threading.Event):
        self._owner = owner
        self._id = future_id
        self._spec = spec
        self._finished = finished  # set by the receiver thread when the program completes or the device dies
        self._lock = threading.Lock()
        self._copy = HostCopy.NONE
        self._value: torch.Tensor | None = None  # [*spec.shape], valid when _copy is VALUE
        self._error = ""  # valid when _copy is ERROR
        self._released = False  # written only under the owner's send lock (see mark_released)

    def __repr__(self) -> str:
        return f"HostFuture(#{self._id}, {self._spec}, {self._copy.value}, released={self._released})"

    @property
    def future_id(self) -> int:
        return self._id

    @property
    def owner(self) -> FutureOwner:
        return self._owner

    @property
    def released(self) -> bool:
        return self._released

    @property
    def spec(self) -> TensorSpec:
        return self._spec

    def done(self) -> bool:
        return self._copy is not HostCopy.NONE or self._finished.is_set()

    def to_host(self) -> torch.Tensor:
        # Hazard: double materialization. The worker main thread and the async output thread may
        # both call this; the per-future lock makes the second caller wait and reuse the first
        # caller's transfer instead of issuing its own.
        with self._lock:
            if self._copy is HostCopy.VALUE:
                assert self._value is not None
                return self._value
            if self._copy is HostCopy.ERROR:
                raise DeviceProgramError(self._error)
            if self._released:
                raise RuntimeError(f"{self!r} was released before it was read")
            try:
                value = self._owner.fetch(self._id)
            except DeviceLostError:
                raise  # not the program's fault; not cached
            except DeviceProgramError as exc:
                self._copy, self._error = HostCopy.ERROR, str(exc)
                raise
            self._copy, self._value = HostCopy.VALUE, value
            return value

    def index_select(self, index: torch.Tensor) -> torch.Tensor:
        return self.to_host().index_select(0, index)

    def release(self) -> None:
        self._owner.release(self)

    def mark_released(self) -> bool:
        """Flag the future released; False if it already was. Caller holds the owner's send lock."""
        if self._released:
            return False
        self._released = True
        return True

    def __del__(self) -> None:
        # getattr: __del__ also runs on a future whose __init__ raised.
        if not getattr(self, "_released", True):
            self._owner.defer_release(self._id)
