"""Lifecycle and faults of the device runtime: startup, bounded queue, device time, loss, close."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from support.toy_programs import Gate, ToyPrograms, in_thread

from neuron_async_sm.config import EngineConfig
from neuron_async_sm.runtime import (
    DeviceLostError,
    DeviceStartupError,
    TensorSpec,
    create_runtime,
)

BACKENDS = ["cpu", "cpu-inprocess"]
I32 = TensorSpec((4,), torch.int32)
WAIT_S = 10.0  # generous bound on anything that should finish "promptly"


def x4() -> torch.Tensor:
    return torch.tensor([1, 2, 3, 4], dtype=torch.int32)  # [4]


def test_unknown_device_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"'tpu'.*'cpu'.*'cpu-inprocess'"):
        create_runtime(EngineConfig(device="tpu"), ToyPrograms())


def test_bad_setting_names_the_field() -> None:
    with pytest.raises(ValueError, match="runtime_queue_depth"):
        create_runtime(EngineConfig(device="cpu-inprocess", runtime_queue_depth=0), ToyPrograms())


@pytest.mark.parametrize("device", BACKENDS)
def test_factory_failure_surfaces_at_construction(device: str) -> None:
    with pytest.raises(DeviceStartupError, match=r"(?s)FileNotFoundError.*/no/such/model\.safetensors"):
        create_runtime(EngineConfig(device=device), ToyPrograms(fail_to_build="/no/such/model.safetensors"))


def test_unpicklable_factory_is_explained() -> None:
    with pytest.raises(DeviceStartupError, match="picklable"):
        create_runtime(EngineConfig(device="cpu"), lambda: {"add_one": lambda x: x + 1})


@pytest.mark.parametrize("device", BACKENDS)
def test_full_queue_blocks_enqueue_until_a_program_finishes(device: str, tmp_path: Path) -> None:
    gate = Gate(tmp_path / "gate")
    with create_runtime(EngineConfig(device=device, runtime_queue_depth=2), ToyPrograms()) as rt:
        held = [rt.enqueue("gated", {"x": x4() * i, "gate": gate.tensor}, I32) for i in (1, 2)]
        third, box = in_thread(lambda: rt.enqueue("add_one", {"x": x4()}, I32))
        third.join(0.3)
        assert third.is_alive(), "the third enqueue must block while two programs are unfinished"
        gate.open()
        third.join(WAIT_S)
        assert not third.is_alive()
        assert held[0].done()  # it was let in by a completion, not by dropping anything
        assert [f.to_host().tolist() for f in held] == [[1, 2, 3, 4], [2, 4, 6, 8]]
        assert box[0].to_host().tolist() == [2, 3, 4, 5]  # type: ignore[union-attr]
        assert rt.stats().programs_completed == 3


@pytest.mark.parametrize("device", BACKENDS)
def test_device_time_is_measured_inside_the_device_and_honours_device_time_ms(device: str) -> None:
    with create_runtime(EngineConfig(device=device, device_time_ms=40), ToyPrograms()) as rt:
        start = time.perf_counter()
        futures = [rt.enqueue("add_one", {"x": x4()}, I32) for _ in range(3)]
        futures[-1].to_host()
        wall = time.perf_counter() - start
        rt.enqueue("sleep", {"x": x4(), "seconds": torch.tensor(0.1)}, I32).to_host()
        stats = rt.stats()
        *held, slept = stats.recent_device_times_s
        assert len(held) == 3 and all(t >= 0.040 for t in held)
        assert slept >= 0.1  # the program's own time, not just the hold
        assert wall >= 0.120 and stats.device_time_s >= 0.220
        assert stats.programs_completed == 4


def test_killed_device_process_releases_every_waiter(tmp_path: Path) -> None:
    gate = Gate(tmp_path / "gate")  # never opened
    with create_runtime(EngineConfig(device="cpu", runtime_queue_depth=1), ToyPrograms()) as rt:
        stuck = rt.enqueue("gated", {"x": x4(), "gate": gate.tensor}, I32)
        reader, read = in_thread(stuck.to_host)
        blocked, enqueued = in_thread(lambda: rt.enqueue("add_one", {"x": x4()}, I32))
        blocked.join(0.3)
        assert reader.is_alive() and blocked.is_alive()
        pid = rt.device_pid  # type: ignore[attr-defined]
        os.kill(pid, signal.SIGKILL)
        reader.join(WAIT_S)
        blocked.join(WAIT_S)
        assert isinstance(read[0], DeviceLostError) and "killed by signal 9" in str(read[0])
        assert isinstance(enqueued[0], DeviceLostError)
        assert stuck.done()
        with pytest.raises(DeviceLostError):
            rt.enqueue("add_one", {"x": x4()}, I32)


@pytest.mark.parametrize("device", BACKENDS)
def test_crashed_device_loop_releases_every_waiter(device: str, tmp_path: Path) -> None:
    gate = Gate(tmp_path / "gate")
    with create_runtime(EngineConfig(device=device), ToyPrograms()) as rt:
        blocker = rt.enqueue("gated", {"x": x4(), "gate": gate.tensor}, I32)
        rt.enqueue("crash", {"x": blocker}, I32)  # raises SystemExit: takes the device loop down
        behind = rt.enqueue("add_one", {"x": x4()}, I32)
        reader, read = in_thread(behind.to_host)
        gate.open()
        reader.join(WAIT_S)
        assert isinstance(read[0], DeviceLostError)
        assert re.search(r"exited with code 3|crashed: SystemExit: 3", str(read[0]))
        with pytest.raises(DeviceLostError):
            blocker.to_host()  # finished, but never fetched before the loss


@pytest.mark.parametrize("device", BACKENDS)
def test_close_with_work_in_flight_does_not_hang(device: str, tmp_path: Path) -> None:
    gate = Gate(tmp_path / "gate")
    rt = create_runtime(EngineConfig(device=device, runtime_queue_depth=2), ToyPrograms())
    try:
        held = [rt.enqueue("gated", {"x": x4(), "gate": gate.tensor}, I32) for _ in range(2)]
        reader, read = in_thread(held[-1].to_host)
        blocked, enqueued = in_thread(lambda: rt.enqueue("add_one", {"x": x4()}, I32))
        blocked.join(0.3)
        closer, _ = in_thread(rt.close)
        closer.join(WAIT_S)
        assert not closer.is_alive(), "close() hung"
        reader.join(WAIT_S)
        blocked.join(WAIT_S)
        assert isinstance(read[0], DeviceLostError) and "closed" in str(read[0])
        assert isinstance(enqueued[0], DeviceLostError)
        rt.close()  # idempotent
        with pytest.raises(DeviceLostError, match="closed"):
            rt.enqueue("add_one", {"x": x4()}, I32)
    finally:
        gate.open()  # lets an abandoned in-process device thread finish
        rt.close()


@pytest.mark.parametrize("device", BACKENDS)
def test_device_reports_how_long_it_waited_for_each_program(device: str) -> None:
    with create_runtime(EngineConfig(device=device), ToyPrograms()) as rt:
        rt.enqueue("add_one", {"x": x4()}, I32).to_host()
        rt.reset_stats()
        rt.enqueue("add_one", {"x": x4()}, I32).to_host()
        time.sleep(0.15)  # the device has nothing queued for at least this long
        rt.enqueue("add_one", {"x": x4()}, I32).to_host()
        stats = rt.stats()
        assert len(stats.recent_device_idle_s) == len(stats.recent_device_times_s) == 2
        assert stats.recent_device_idle_s[1] >= 0.15
        assert stats.device_idle_s == pytest.approx(sum(stats.recent_device_idle_s))
