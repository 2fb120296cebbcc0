"""Pieces of the runtime without a transport: wire format, specs, config, the device loop itself."""

from __future__ import annotations

from collections import deque

import pytest
import torch
from support.toy_programs import ToyPrograms

from neuron_async_sm.config import DEVICES, ConfigError, EngineConfig
from neuron_async_sm.runtime import TensorSpec, create_runtime
from neuron_async_sm.runtime.device_loop import DeviceLoop
from neuron_async_sm.runtime.devices import DeviceKind
from neuron_async_sm.runtime.messages import (
    DeviceMessage,
    Fetch,
    Fetched,
    FutureRef,
    HostMessage,
    ProgramDone,
    Ready,
    Release,
    RunProgram,
    Shutdown,
    WireTensor,
)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(8, dtype=torch.int32),
        torch.randn(3, 5).to(torch.bfloat16),
        torch.tensor([True, False, True]),
        torch.tensor(7, dtype=torch.int64),  # 0-dim
        torch.empty(0, 4, dtype=torch.float16),
        torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),  # non-contiguous
    ],
)
def test_wire_tensor_round_trips_every_dtype_and_layout(tensor: torch.Tensor) -> None:
    original = tensor.clone()
    decoded = WireTensor.encode(tensor).decode()
    assert decoded.dtype == tensor.dtype and decoded.shape == tensor.shape
    assert torch.equal(decoded, tensor)
    decoded.zero_()  # writable, and not aliased with the source
    assert torch.equal(tensor, original)


def test_tensor_spec_rejects_bad_fields() -> None:
    with pytest.raises(ValueError, match="shape"):
        TensorSpec((2, -1), torch.int32)
    with pytest.raises(ValueError, match="dtype"):
        TensorSpec((2,), "int32")  # type: ignore[arg-type]
    assert TensorSpec.of(torch.zeros(2, 3, dtype=torch.int8)) == TensorSpec((2, 3), torch.int8)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("runtime_queue_depth", 0),
        ("device_time_ms", -1.0),
        ("device_threads", 0),
        ("device_timeout_s", float("nan")),
        ("device_cpu", 0),  # pinning needs the device process, not a thread
    ],
)
def test_a_bad_runtime_setting_is_rejected_by_engine_config_naming_the_field(field, value) -> None:
    with pytest.raises(ConfigError, match=f"^{field}: "):  # validated by EngineConfig, the one place
        EngineConfig(device="cpu-inprocess", **{field: value})


def test_the_runtime_reads_its_settings_from_the_engine_config() -> None:
    assert {kind.value for kind in DeviceKind} == set(DEVICES)
    with create_runtime(EngineConfig(device="cpu-inprocess", runtime_queue_depth=3), ToyPrograms()) as runtime:
        assert runtime.runtime_queue_depth == 3


class ScriptedChannel:
    """Feeds the device loop a fixed script, all of it already queued; records replies."""

    def __init__(self, script: list[HostMessage]) -> None:
        self.inbox: deque[HostMessage] = deque(script)
        self.sent: list[DeviceMessage] = []

    def recv(self, block: bool) -> HostMessage | None:
        if self.inbox:
            return self.inbox.popleft()
        if block:
            raise EOFError
        return None

    def send(self, message: DeviceMessage) -> None:
        self.sent.append(message)


def run(program: str, seq: int, **inputs: torch.Tensor | int) -> RunProgram:
    wire = {k: FutureRef(v) if isinstance(v, int) else WireTensor.encode(v) for k, v in inputs.items()}
    return RunProgram(seq, program, wire, (4,), torch.int32)


def x4() -> torch.Tensor:
    return torch.tensor([1, 2, 3, 4], dtype=torch.int32)  # [4]


def test_loop_frees_released_memory_only_after_earlier_consumers_ran() -> None:
    channel = ScriptedChannel(
        [run("add_one", 0, x=x4()), run("add_one", 1, x=0), Release((0,)), Fetch(0, 1), Fetch(1, 0)]
    )
    DeviceLoop(device_time_ms=0).serve(channel, ToyPrograms())
    ready, done0, done1, fetched1, fetched0 = channel.sent
    assert isinstance(ready, Ready) and "add_one" in ready.programs
    assert isinstance(done1, ProgramDone) and done1.error is None and done1.live_futures == 2
    assert isinstance(fetched1, Fetched) and fetched1.value is not None
    assert fetched1.value.decode().tolist() == [3, 4, 5, 6]
    assert isinstance(fetched0, Fetched) and "released" in (fetched0.error or "")


def test_loop_drops_work_queued_behind_shutdown() -> None:
    channel = ScriptedChannel([run("add_one", 0, x=x4()), run("add_one", 1, x=x4()), Shutdown()])
    DeviceLoop(device_time_ms=0).serve(channel, ToyPrograms())
    assert [type(m) for m in channel.sent] == [Ready]
