"""Nothing waits forever: a device that stops responding (a real SIGSTOPped device process, no mocks)
is declared hung after device_timeout_s, and teardown is bounded even while the device is stopped.

A stopped process is the hang that matters: it holds its pipe open, so no EOF ever tells the host
it is gone, and SIGTERM stays pending until SIGCONT.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from support.processes import process_gone
from support.toy_programs import Gate, ToyPrograms, in_thread

from neuron_async_sm import LLM, ConfigError, EngineConfig, EngineDeadError, SamplingParams
from neuron_async_sm.runtime import DeviceHungError, DeviceLostError, DeviceStartupError, TensorSpec, create_runtime

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 3.0  # device_timeout_s of the hang tests
LONG = SamplingParams(max_tokens=200, ignore_eos=True)  # still running when the device is stopped
I32 = TensorSpec((4,), torch.int32)
ENGINE_THREADS = ("async-output", "neuron-device-rx", "neuron-device-watchdog")


def x4() -> torch.Tensor:
    return torch.tensor([1, 2, 3, 4], dtype=torch.int32)  # [4]


def engine_threads_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name in ENGINE_THREADS and t.is_alive()]


def start_requests(llm: LLM, n: int = 4) -> None:
    for i in range(n):
        llm.add_request([5 + i, 6, 7], LONG, f"r{i}")
    for _ in range(3):
        llm.step()  # a few steps run: the device is mid-run, not starting


def step_until_finished(llm: LLM) -> dict[str, object]:
    finishes = {}
    while llm.has_unfinished_requests():
        for delta in llm.step():
            if delta.finish_reason:
                finishes[delta.request_id] = delta
    return finishes


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_stopped_device_is_declared_hung_and_every_request_ends_with_the_error(async_scheduling):
    llm = LLM("tiny-llama", device="cpu", async_scheduling=async_scheduling, device_timeout_s=TIMEOUT_S)
    pid = llm.engine.runtime.device_pid
    try:
        start_requests(llm)
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        stepper, result = in_thread(lambda: step_until_finished(llm))
        stepper.join(TIMEOUT_S + 5)
        elapsed = time.monotonic() - stopped
        assert not stepper.is_alive(), f"no DeviceHungError {elapsed:.1f} s after SIGSTOP"
        [finishes] = result
        assert isinstance(finishes, dict), finishes
        assert sorted(finishes) == ["r0", "r1", "r2", "r3"]
        assert {d.finish_reason for d in finishes.values()} == {"error"}
        assert all(d.error.startswith("DeviceHungError: ") for d in finishes.values()), finishes
        assert f"killed device process {pid}" in finishes["r0"].error
        assert elapsed >= TIMEOUT_S - 0.5, "declared hung before device_timeout_s"
        print(f"SIGSTOP -> every request errored: {elapsed:.2f} s (device_timeout_s={TIMEOUT_S})")
        assert process_gone(pid), "the hung device process is still there"
        assert engine_threads_alive() == []
        with pytest.raises(EngineDeadError, match="DeviceHungError"):
            llm.step()
    finally:
        if not process_gone(pid):
            os.kill(pid, signal.SIGKILL)
        llm.close()


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_close_on_a_stopped_device_returns_within_seconds(async_scheduling):
    # Watchdog off: nothing but close() itself can bring the stopped device down. Programs held 50 ms:
    # in async mode the step enqueued ahead is still on the device when it stops.
    llm = LLM("tiny-llama", device="cpu", async_scheduling=async_scheduling, device_timeout_s=0, device_time_ms=50)
    pid = llm.engine.runtime.device_pid
    try:
        start_requests(llm)
        os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        closer, _ = in_thread(llm.close)
        closer.join(10)
        elapsed = time.monotonic() - started
        assert not closer.is_alive(), "close() hangs on a stopped device"
        print(f"close() on a stopped device: {elapsed:.2f} s")
        # The close grace (1 s), then SIGTERM made deliverable by SIGCONT. A stopped child keeps a bare
        # SIGTERM pending: that would add stop()'s whole 1 s wait before the SIGKILL.
        assert elapsed < 2.0
        assert process_gone(pid)
        assert engine_threads_alive() == []
    finally:
        if not process_gone(pid):
            os.kill(pid, signal.SIGKILL)
        llm.close()


def test_zero_timeout_disables_the_watchdog():
    # Stopped for 1 s, then continued: a watchdog that took 0 as "0 seconds" would fire at once.
    with LLM("tiny-llama", device="cpu", async_scheduling=True, device_timeout_s=0) as llm:
        start_requests(llm, n=2)
        pid = llm.engine.runtime.device_pid
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(1.0, os.kill, (pid, signal.SIGCONT)).start()
        finishes = step_until_finished(llm)
        assert {d.finish_reason for d in finishes.values()} == {"length"}
        assert "neuron-device-watchdog" not in engine_threads_alive()


def test_interrupt_during_a_hang_exits_promptly(tmp_path):
    """Ctrl-C while the main thread waits on a stopped device (watchdog off): the `with` block's close()
    kills the device instead of waiting, and the process exits."""
    script = tmp_path / "hang.py"
    script.write_text(
        textwrap.dedent("""
        import sys, time
        from neuron_async_sm import LLM, SamplingParams
        if __name__ == "__main__":
            try:
                with LLM("tiny-llama", device="cpu", device_timeout_s=0) as llm:
                    llm.add_request([5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True))
                    llm.step()
                    print(llm.engine.runtime.device_pid, flush=True)
                    try:
                        while llm.has_unfinished_requests():
                            llm.step()
                    finally:
                        started = time.monotonic()  # the with block's close() runs next
            except KeyboardInterrupt:
                print(f"{time.monotonic() - started:.3f}", flush=True)
                sys.exit(130)
    """)
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    pid = None
    try:
        pid = int(proc.stdout.readline())
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.5)  # the main thread is now blocked on the stopped device
        interrupted = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(10)
        elapsed = time.monotonic() - interrupted
        out, err = proc.communicate()
        assert proc.returncode == 130, (out, err)
        close_s = float(out)
        print(f"SIGINT during a hang -> close() {close_s:.3f} s, process exit {elapsed:.2f} s")
        # Bounds far below the waits they guard (a close() that waits on the device never returns; the
        # old shutdown took 60 s), with slack for a loaded 2-core CI.
        assert close_s < 2.0, "close() after an interrupt waited for the device"
        assert elapsed < 5.0, f"exit took {elapsed:.2f} s after Ctrl-C"
        assert process_gone(pid)
    finally:
        proc.kill()
        if pid is not None and not process_gone(pid):
            os.kill(pid, signal.SIGKILL)


# ---- the runtime's watchdog, on both backends ----------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_an_interrupted_step_leaves_the_engine_dead_not_half_stepped(async_scheduling):
    """Ctrl-C inside step() can land anywhere in it (a step scheduled but not enqueued, tokens half
    applied): every later call fails with EngineDeadError naming the interrupt instead of stepping on
    from a state nobody knows, and the `with` block still tears down at once."""
    with LLM("tiny-llama", device="cpu-inprocess", async_scheduling=async_scheduling, device_time_ms=5000) as llm:
        llm.add_request([5, 6, 7], LONG, "r0")
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()  # mid-step: the device holds 5 s
        with pytest.raises(KeyboardInterrupt):
            while True:
                llm.step()
        with pytest.raises(EngineDeadError, match="interrupted"):
            llm.step()
        with pytest.raises(EngineDeadError, match="interrupted"):
            llm.add_request([1, 2], LONG, "r1")


def test_hung_device_process_releases_a_reader_and_a_blocked_enqueue():
    rt = create_runtime(EngineConfig(device="cpu", runtime_queue_depth=1, device_timeout_s=1.0), ToyPrograms())
    pid = rt.device_pid  # type: ignore[attr-defined]
    try:
        assert rt.enqueue("add_one", {"x": x4()}, I32).to_host().tolist() == [2, 3, 4, 5]
        os.kill(pid, signal.SIGSTOP)
        stuck = rt.enqueue("add_one", {"x": x4()}, I32)
        reader, read = in_thread(stuck.to_host)
        blocked, enqueued = in_thread(lambda: rt.enqueue("add_one", {"x": x4()}, I32))
        started = time.monotonic()
        reader.join(6)
        blocked.join(6)
        elapsed = time.monotonic() - started
        assert isinstance(read[0], DeviceHungError), read
        assert isinstance(enqueued[0], DeviceHungError), enqueued
        assert "device runtime is hung: no program completed" in str(read[0])
        assert 0.8 <= elapsed < 3.0, elapsed
        assert process_gone(pid)
        with pytest.raises(DeviceHungError):
            rt.enqueue("add_one", {"x": x4()}, I32)
    finally:
        if not process_gone(pid):
            os.kill(pid, signal.SIGKILL)
        rt.close()


def test_hung_device_thread_is_abandoned_and_its_waiters_released(tmp_path):
    gate = Gate(tmp_path / "gate")  # a program that never finishes: how a device thread hangs
    rt = create_runtime(EngineConfig(device="cpu-inprocess", device_timeout_s=0.5), ToyPrograms())
    try:
        stuck = rt.enqueue("gated", {"x": x4(), "gate": gate.tensor}, I32)
        reader, read = in_thread(stuck.to_host)
        reader.join(5)
        assert isinstance(read[0], DeviceHungError), read
        assert "abandoned the device thread" in str(read[0])
        assert isinstance(read[0], DeviceLostError)  # handled wherever a lost device is
    finally:
        gate.open()  # the abandoned thread finishes its program and exits on close's Shutdown
        rt.close()


def test_hung_local_device_releases_a_blocked_enqueue_and_fails_what_follows(tmp_path):
    """The same watchdog on LocalRuntime (xla, accelerator): here the accelerator backend on this machine's CPU,
    where a program runs inside enqueue, with a program that never returns (the gate stays shut)."""
    gate = Gate(tmp_path / "gate")
    rt = create_runtime(EngineConfig(device="accelerator", runtime_queue_depth=1, device_timeout_s=0.5), ToyPrograms())
    try:
        assert rt.enqueue("add_one", {"x": x4()}, I32).to_host().tolist() == [2, 3, 4, 5]
        stuck, issued = in_thread(lambda: rt.enqueue("gated", {"x": x4(), "gate": gate.tensor}, I32))

        def enqueue_until_refused() -> None:
            while True:  # quick while the stuck program has not taken the one slot; then blocked until the hang
                rt.enqueue("add_one", {"x": x4()}, I32).to_host()

        blocked, refused = in_thread(enqueue_until_refused)
        blocked.join(30)  # a bound against a broken watchdog, not a timing claim
        assert not blocked.is_alive(), "an enqueue blocked behind a hung device was never released"
        assert isinstance(refused[0], DeviceHungError), refused
        assert "device runtime is hung: no program completed" in str(refused[0])
        assert "abandoned the device" in str(refused[0])
        assert "hung" in (rt.down_reason or "") or "no program completed" in (rt.down_reason or "")
        with pytest.raises(DeviceHungError):
            rt.enqueue("add_one", {"x": x4()}, I32)
    finally:
        gate.open()  # the stuck program returns; its enqueue hands back a future of a hung runtime
        stuck.join(30)
        rt.close()
    [future] = issued
    with pytest.raises(DeviceHungError):
        future.to_host()


@pytest.mark.parametrize("device", ["cpu", "cpu-inprocess", "accelerator"])
def test_idle_or_slow_but_progressing_device_is_not_hung(device):
    with create_runtime(EngineConfig(device=device, device_timeout_s=0.5), ToyPrograms()) as rt:
        time.sleep(1.0)  # idle longer than the timeout: silence without work is not a hang
        assert rt.enqueue("add_one", {"x": x4()}, I32).to_host().tolist() == [2, 3, 4, 5]
        seconds = torch.tensor(0.3)
        # 1.5 s of work, more than the timeout, but each program completes within it.
        futures = [rt.enqueue("sleep", {"x": x4(), "seconds": seconds}, I32) for _ in range(5)]
        assert [f.to_host().tolist() for f in futures] == [[1, 2, 3, 4]] * 5


def test_inprocess_engine_with_a_hung_device_thread_dies_with_device_hung_error():
    # A program held for 3 s (six timeouts) is a device thread that stopped completing anything.
    with LLM("tiny-llama", device="cpu-inprocess", device_timeout_s=0.5, device_time_ms=3_000) as llm:
        llm.add_request([5, 6, 7], LONG, "r0")
        stepper, result = in_thread(lambda: step_until_finished(llm))
        stepper.join(10)
        assert not stepper.is_alive()
        [finishes] = result
        assert finishes["r0"].finish_reason == "error"
        assert "DeviceHungError" in finishes["r0"].error and "abandoned the device thread" in finishes["r0"].error


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), "3", True])
def test_device_timeout_must_be_a_finite_non_negative_number(value):
    with pytest.raises(ConfigError, match="device_timeout_s"):
        EngineConfig(device_timeout_s=value)


def stop_spawned_device(stopped: list[int]) -> None:
    """SIGSTOP this process's spawned device child as soon as it appears (Linux /proc; up to 20 s)."""
    me = str(os.getpid())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                parent = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]
                command = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if parent == me and b"spawn_main" in command:
                os.kill(int(entry), signal.SIGSTOP)
                stopped.append(int(entry))
                return
        time.sleep(0.005)


def test_a_device_never_ready_fails_start_up_within_device_startup_timeout_s() -> None:
    """A device process stopped while it loads (a real SIGSTOP) never sends Ready: start-up fails
    after device_startup_timeout_s naming the limit, the stopped device is killed, nothing is left."""
    stopped: list[int] = []
    watcher = threading.Thread(target=stop_spawned_device, args=(stopped,))
    watcher.start()
    started = time.monotonic()
    try:
        with pytest.raises(DeviceStartupError, match=r"not ready within device_startup_timeout_s=2 s"):
            LLM("tiny-llama", device="cpu", device_startup_timeout_s=2.0)
    finally:
        watcher.join()
    assert stopped, "the device process was never seen"
    assert 2.0 <= time.monotonic() - started < 30
    assert process_gone(stopped[0])
    assert engine_threads_alive() == []


def test_device_startup_timeout_s_is_validated() -> None:
    with pytest.raises(ConfigError, match="device_startup_timeout_s"):
        EngineConfig(device_startup_timeout_s=-1)
