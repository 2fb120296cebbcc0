"""What the worker relies on from a device runtime, checked on every backend this machine has.

Each test names one promise of `neuron_async_sm/runtime/api.py`. Programs come from `ContractPrograms`
(no model); failures come from a program that raises, not from a test hook in the protocol.
"""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest
import torch
from device_work import device_work
from programs import ContractPrograms, heavy_reference
from support.faulty_runtime import FaultyPrograms, FaultyRuntime

from neuron_async_sm.config import EngineConfig
from neuron_async_sm.runtime import DeviceLostError, DeviceProgramError, TensorSpec, create_runtime

VEC = TensorSpec((4,), torch.float32)


class Heavy:
    """Inputs of heavy(x) sized so the device works ~0.3-1 s on this machine (XLA's CPU client is ~10x faster)."""

    def __init__(self, backend) -> None:
        self.size = 1024 if backend.name == "xla" else 512
        self.spec = TensorSpec((self.size, self.size), torch.float32)

    def input(self, seed: int = 0) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(self.size, self.size, generator=gen) / self.size**0.5  # [size, size]

    def warm(self, runtime) -> float:
        """Run heavy twice: a compiling backend compiles it in the first; returns the second's seconds."""
        runtime.enqueue("heavy", {"x": self.input()}, self.spec).to_host()
        started = time.perf_counter()
        runtime.enqueue("heavy", {"x": self.input()}, self.spec).to_host()
        return time.perf_counter() - started


@pytest.fixture
def heavy(backend) -> Heavy:
    return Heavy(backend)


@pytest.fixture
def runtime(backend):
    with create_runtime(EngineConfig(device=backend.name, runtime_queue_depth=8), ContractPrograms()) as rt:
        yield rt


def device_reads(backend) -> int | None:
    """Device->host transfers as the device library itself counts them (XLA), None where it has no counter."""
    work = device_work(backend.name)
    return None if work is None else work[1]


def test_enqueue_returns_before_the_program_ran(backend, runtime, heavy):
    if not backend.asynchronous:
        pytest.skip(f"{backend.name} documents synchronous execution here (no accelerator)")
    heavy.warm(runtime)
    started = time.perf_counter()
    future = runtime.enqueue("heavy", {"x": heavy.input(1)}, heavy.spec)
    enqueued = time.perf_counter() - started
    assert not future.done()  # the device is still working on it
    future.to_host()
    ran = time.perf_counter() - started
    assert future.done()
    assert enqueued < 0.5 * ran, (enqueued, ran)


def test_programs_run_in_enqueue_order(runtime):
    x = torch.zeros(1)
    futures = [runtime.enqueue("tick", {"x": x}, TensorSpec((1,), torch.int64)) for _ in range(6)]
    # Read newest first, so that reading cannot be what orders them.
    values = [int(f.to_host()[0]) for f in reversed(futures)]
    assert values[::-1] == [1, 2, 3, 4, 5, 6]


def test_a_future_feeds_a_later_program_without_a_host_copy(backend, runtime):
    x = torch.arange(4, dtype=torch.float32)
    reads_before = device_reads(backend)
    first = runtime.enqueue("add_one", {"x": x}, VEC)
    second = runtime.enqueue("add_one", {"x": first}, VEC)
    both = runtime.enqueue("add", {"a": second, "b": first}, VEC)
    both_done = both.done() or backend.asynchronous  # read the flag before anything could force it
    stats = runtime.stats()
    assert stats.host_transfers == 0 and stats.host_uploads == 1, stats  # only x crossed, host to device
    if reads_before is not None:
        assert device_reads(backend) == reads_before  # the device library saw no read-back either
    assert both_done
    assert both.to_host().tolist() == [3.0, 5.0, 7.0, 9.0]  # (x + 2) + (x + 1)
    assert runtime.stats().host_transfers == 1


def test_to_host_blocks_and_returns_the_right_values_once(runtime, heavy):
    x = heavy.input(2)
    future = runtime.enqueue("heavy", {"x": x}, heavy.spec)
    results: list[torch.Tensor] = []
    readers = [threading.Thread(target=lambda: results.append(future.to_host())) for _ in range(3)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(timeout=60)
    assert len(results) == 3 and future.done()
    torch.testing.assert_close(results[0], heavy_reference(x), rtol=1e-3, atol=1e-4)
    assert all(r is results[0] for r in results)  # one transfer, one cached tensor for every caller
    assert runtime.stats().host_transfers == 1


def test_a_host_side_gather_forces_the_future(runtime):
    future = runtime.enqueue("add_one", {"x": torch.arange(6, dtype=torch.float32)}, TensorSpec((6,), torch.float32))
    rows = future.index_select(torch.tensor([3, 0, 5]))
    assert rows.tolist() == [4.0, 1.0, 6.0]
    assert future.done()
    assert runtime.stats().host_transfers == 1


def test_a_failing_program_fails_its_dependants_and_every_read(runtime):
    x = torch.ones(4)
    failed = runtime.enqueue("fail", {"x": x}, VEC)
    child = runtime.enqueue("add_one", {"x": failed}, VEC)
    grandchild = runtime.enqueue("add", {"a": child, "b": runtime.enqueue("add_one", {"x": x}, VEC)}, VEC)
    unrelated = runtime.enqueue("add_one", {"x": x}, VEC)
    for future in (failed, child, grandchild, failed, grandchild):  # every read, not only the first
        with pytest.raises(DeviceProgramError, match="boom on a \\(4,\\) input"):
            future.to_host()
    assert unrelated.to_host().tolist() == [2.0] * 4  # the device goes on
    assert runtime.stats().programs_failed == 3


def test_an_injected_failure_fails_the_chosen_program_on_the_device(backend):
    """The fault tests' wrapper (tests/support/faulty_runtime.py) works on this backend: the chosen program
    fails as a failing program does here (dependants fail with its root cause), its neighbours run."""
    with FaultyRuntime(
        create_runtime(EngineConfig(device=backend.name, runtime_queue_depth=8), FaultyPrograms(ContractPrograms()))
    ) as runtime:
        x = torch.ones(4)
        runtime.inject_failure(after=1)
        before = runtime.enqueue("add_one", {"x": x}, VEC)
        chosen = runtime.enqueue("add_one", {"x": before}, VEC)
        child = runtime.enqueue("add", {"a": chosen, "b": before}, VEC)
        after = runtime.enqueue("add_one", {"x": before}, VEC)
        assert after.to_host().tolist() == [3.0] * 4 and before.to_host().tolist() == [2.0] * 4
        for future in (chosen, child, chosen):
            with pytest.raises(DeviceProgramError, match="InjectedFailure: injected failure in place of 'add_one'"):
                future.to_host()
        stats = runtime.stats()
        assert (stats.programs_failed, stats.programs_completed) == (2, 2), stats
        with pytest.raises(ValueError, match="after must be an int >= 0"):
            runtime.inject_failure(after=-1)


def test_a_future_carries_the_dtype_the_device_produced(runtime):
    future = runtime.enqueue("widen", {"x": torch.arange(4, dtype=torch.int32)}, TensorSpec((4,), torch.int32))
    try:
        value = future.to_host()
    except DeviceProgramError:
        return  # a backend that insists on the requested dtype fails the program instead (the emulator)
    assert future.dtype == torch.int64 and value.dtype == future.dtype, (future.spec, value.dtype)
    assert value.tolist() == [0, 1, 2, 3]


def test_a_float_where_an_integer_was_expected_fails_the_program(runtime):
    future = runtime.enqueue("add_one", {"x": torch.zeros(4)}, TensorSpec((4,), torch.int32))
    with pytest.raises(DeviceProgramError, match="expected torch.int32"):
        future.to_host()


def test_the_bounded_queue_blocks_instead_of_dropping(backend, heavy):
    depth = 2
    with create_runtime(EngineConfig(device=backend.name, runtime_queue_depth=depth), ContractPrograms()) as runtime:
        run_s = heavy.warm(runtime)
        inputs = [heavy.input(10 + i) for i in range(depth + 1)]
        futures = [runtime.enqueue("heavy", {"x": inputs[i]}, heavy.spec) for i in range(depth)]
        seen: dict[str, bool] = {}

        def one_more() -> None:
            futures.append(runtime.enqueue("heavy", {"x": inputs[depth]}, heavy.spec))
            seen["oldest done when it returned"] = futures[0].done()

        extra = threading.Thread(target=one_more, daemon=True)
        extra.start()
        if backend.asynchronous:
            # A fraction of one program's time: on a fast machine heavy may take well under 50 ms, and
            # the oldest finishing (which frees the slot) is then no longer a bug.
            extra.join(timeout=min(0.05, run_s / 4))
            assert extra.is_alive(), f"enqueue past the queue depth returned while the queue was full ({run_s=:.3f})"
        extra.join(timeout=60)
        assert seen == {"oldest done when it returned": True}
        for x, future in zip(inputs, futures, strict=True):  # nothing dropped, nothing mixed up
            torch.testing.assert_close(future.to_host(), heavy_reference(x), rtol=1e-3, atol=1e-4)


def _runtime_threads() -> set[threading.Thread]:
    # A device library's own threads that once ran a Python callback show up as _DummyThread; they
    # belong to the library (PJRT's pool), live as long as it does, and are not the runtime's to stop.
    return {t for t in threading.enumerate() if not isinstance(t, threading._DummyThread)}


def test_close_with_programs_in_flight_returns_and_leaks_nothing(backend, heavy):
    threads_before = _runtime_threads()
    runtime = create_runtime(EngineConfig(device=backend.name, runtime_queue_depth=8), ContractPrograms())
    heavy.warm(runtime)
    futures = [runtime.enqueue("heavy", {"x": heavy.input(20 + i)}, heavy.spec) for i in range(4)]
    started = time.perf_counter()
    runtime.close()
    assert time.perf_counter() - started < 10.0
    with pytest.raises(DeviceLostError):
        futures[-1].to_host()
    with pytest.raises(DeviceLostError):
        runtime.enqueue("add_one", {"x": torch.zeros(4)}, VEC)
    deadline = time.monotonic() + 5.0
    while (_runtime_threads() - threads_before or multiprocessing.active_children()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _runtime_threads() - threads_before
    assert not multiprocessing.active_children()
