"""Semantics of the device runtime, on both backends (one shared runtime per backend)."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.toy_programs import Gate, ToyPrograms, in_thread

from neuron_async_sm.config import EngineConfig
from neuron_async_sm.runtime import (
    DeviceFuture,
    DeviceProgramError,
    DeviceRuntime,
    TensorSpec,
    WireTensor,
    create_runtime,
)

BACKENDS = ["cpu", "cpu-inprocess"]
I32 = TensorSpec((4,), torch.int32)
STAMP = TensorSpec((1,), torch.int64)
WAIT_S = 10.0  # generous bound on anything that should finish "promptly"


@pytest.fixture(scope="module", params=BACKENDS)
def shared_runtime(request: pytest.FixtureRequest) -> Iterator[DeviceRuntime]:
    with create_runtime(EngineConfig(device=request.param), ToyPrograms()) as runtime:
        yield runtime


@pytest.fixture
def rt(shared_runtime: DeviceRuntime) -> DeviceRuntime:
    shared_runtime.reset_stats()
    return shared_runtime


@pytest.fixture
def gate(tmp_path: Path) -> Gate:
    return Gate(tmp_path / "gate")


def x4() -> torch.Tensor:
    return torch.tensor([1, 2, 3, 4], dtype=torch.int32)  # [4]


def test_programs_execute_in_enqueue_order(rt: DeviceRuntime) -> None:
    # Independent programs, the slowest first: only in-order execution finishes them in this order.
    delays = [0.04, 0.03, 0.02, 0.01, 0.0]
    futures = [rt.enqueue("stamp", {"x": x4(), "seconds": torch.tensor(d)}, STAMP) for d in delays]
    stamps = [int(f.to_host()[0]) for f in reversed(futures)][::-1]  # fetch order must not matter
    assert stamps == list(range(stamps[0], stamps[0] + len(futures)))


def test_future_feeds_next_program_without_visiting_host(rt: DeviceRuntime) -> None:
    f1 = rt.enqueue("add_one", {"x": x4()}, I32)
    f2 = rt.enqueue("add", {"a": f1, "b": f1}, I32)
    f3 = rt.enqueue("add_one", {"x": f2}, I32)
    assert f3.to_host().tolist() == [5, 7, 9, 11]
    stats = rt.stats()
    assert stats.host_uploads == 1  # only x4(); f1 and f2 stayed on the device
    assert stats.host_transfers == 1  # only f3
    assert stats.programs_completed == 3


def test_to_host_blocks_until_ready_while_enqueue_stays_free(rt: DeviceRuntime, gate: Gate) -> None:
    future = rt.enqueue("gated", {"x": x4(), "gate": gate.tensor}, I32)
    waiter, box = in_thread(future.to_host)
    waiter.join(0.3)
    assert waiter.is_alive() and not future.done()
    # enqueue must not wait for the thread blocked in to_host
    enqueuer, queued = in_thread(lambda: rt.enqueue("add_one", {"x": future}, I32))
    enqueuer.join(WAIT_S)
    assert not enqueuer.is_alive() and isinstance(queued[0], DeviceFuture)
    gate.open()
    waiter.join(WAIT_S)
    assert box[0].tolist() == [1, 2, 3, 4]  # type: ignore[union-attr]
    assert future.done()
    assert queued[0].to_host().tolist() == [2, 3, 4, 5]  # type: ignore[union-attr]


def test_concurrent_to_host_transfers_once(rt: DeviceRuntime, gate: Gate) -> None:
    future = rt.enqueue("gated", {"x": x4(), "gate": gate.tensor}, I32)
    (t1, box1), (t2, box2) = in_thread(future.to_host), in_thread(future.to_host)
    t1.join(0.2)
    gate.open()
    t1.join(WAIT_S)
    t2.join(WAIT_S)
    assert box1[0] is box2[0]  # one cached tensor, shared
    assert rt.stats().host_transfers == 1


def test_index_select_forces_the_future(rt: DeviceRuntime, gate: Gate) -> None:
    future = rt.enqueue("gated", {"x": x4(), "gate": gate.tensor}, I32)
    threading.Timer(0.2, gate.open).start()
    assert future.index_select(torch.tensor([3, 0])).tolist() == [4, 1]
    assert future.done()
    assert rt.stats().host_transfers == 1


def test_program_error_reaches_to_host_and_dependents(rt: DeviceRuntime) -> None:
    failed = rt.enqueue("fail", {"x": x4()}, I32)
    child = rt.enqueue("add_one", {"x": failed}, I32)
    grandchild = rt.enqueue("add", {"a": child, "b": x4()}, I32)
    healthy = rt.enqueue("add_one", {"x": x4()}, I32)
    with pytest.raises(DeviceProgramError, match=r"program 'fail' \(#\d+\) failed: ValueError: boom"):
        failed.to_host()
    for dependent, name in ((child, "add_one"), (grandchild, "add")):
        with pytest.raises(DeviceProgramError) as info:
            dependent.to_host()
        message = str(info.value)
        assert f"program '{name}'" in message and "not run" in message
        assert message.count("boom") == 1 and "program 'fail'" in message  # the root cause, once
    assert healthy.to_host().tolist() == [2, 3, 4, 5]
    with pytest.raises(DeviceProgramError, match="boom"):
        failed.to_host()  # raises again on every read
    assert rt.stats().programs_failed == 3


def test_release_waits_for_queued_consumers(rt: DeviceRuntime, gate: Gate) -> None:
    produced = rt.enqueue("gated", {"x": x4(), "gate": gate.tensor}, I32)
    consumer = rt.enqueue("add_one", {"x": produced}, I32)
    produced.release()  # sent while the consumer is still queued behind the gate
    produced.release()  # idempotent
    gate.open()
    assert consumer.to_host().tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="released"):
        rt.enqueue("add_one", {"x": produced}, I32)
    with pytest.raises(RuntimeError, match="released"):
        produced.to_host()


def test_garbage_collected_futures_free_device_memory(rt: DeviceRuntime) -> None:
    gc.collect()
    baseline_probe = rt.enqueue("add_one", {"x": x4()}, I32)
    baseline_probe.to_host()
    baseline = rt.stats().device_futures_live  # includes baseline_probe
    kept = [rt.enqueue("add_one", {"x": x4()}, I32) for _ in range(5)]
    kept[-1].to_host()
    assert rt.stats().device_futures_live == baseline + 5
    del kept
    gc.collect()
    rt.enqueue("add_one", {"x": x4()}, I32).to_host()  # carries the deferred releases
    assert rt.stats().device_futures_live == baseline + 1


def test_output_spec_mismatch_fails_the_program(rt: DeviceRuntime) -> None:
    wrong = rt.enqueue("add_one", {"x": x4()}, TensorSpec((4,), torch.float32))
    with pytest.raises(DeviceProgramError, match=r"expected torch.float32\[4\]"):
        wrong.to_host()


def test_unknown_program_is_rejected_at_enqueue(rt: DeviceRuntime) -> None:
    with pytest.raises(ValueError, match="'nope'.*add_one"):
        rt.enqueue("nope", {"x": x4()}, I32)


def test_host_inputs_are_copied_at_enqueue(rt: DeviceRuntime, gate: Gate) -> None:
    x = x4()
    future = rt.enqueue("gated", {"x": x, "gate": gate.tensor}, I32)
    x.fill_(0)  # the device must still see the value at enqueue time
    gate.open()
    assert future.to_host().tolist() == [1, 2, 3, 4]


def test_an_encoded_host_tensor_is_an_input_like_the_tensor(rt: DeviceRuntime) -> None:
    """A WireTensor (a host tensor as immutable bytes, encoded once by the caller) is sent as is: the
    program sees the tensor, counted as an upload; a WireTensor over mutable data is refused."""
    wire = WireTensor.encode(x4())
    out = rt.enqueue("add", {"a": wire, "b": x4()}, I32).to_host()
    assert out.tolist() == [2, 4, 6, 8]
    assert rt.stats().host_uploads == 2
    with pytest.raises(TypeError, match="must be bytes"):
        rt.enqueue("add_one", {"x": WireTensor(bytearray(wire.data), wire.shape, wire.dtype)}, I32)


def test_an_encoded_host_tensor_is_an_input_on_a_local_device() -> None:
    with create_runtime(EngineConfig(device="accelerator"), ToyPrograms()) as runtime:
        out = runtime.enqueue("add", {"a": WireTensor.encode(x4()), "b": x4()}, I32).to_host()
        assert out.tolist() == [2, 4, 6, 8]


def test_a_program_message_larger_than_the_pipe_buffer_arrives_whole(rt: DeviceRuntime) -> None:
    """The process channel writes each message's frame to the pipe itself (several writes when the
    pipe is full): an input of 1 MiB reaches the device intact."""
    big = torch.arange(1 << 18, dtype=torch.int32)  # [262144], 1 MiB
    out = rt.enqueue("add_one", {"x": big}, TensorSpec((1 << 18,), torch.int32)).to_host()
    assert torch.equal(out, big + 1)
