"""Measurements behind the runtime's design choices (not a test: timings are machine-dependent).

    python -m neuron_async_sm.bench.runtime_micro [--iters N]

1. Wire format: round trip of a tiny int32[8] tensor over a raw spawn pipe,
   sent as a torch tensor (torch's shared-memory reduction) versus as bytes.
2. Runtime round trip: ``enqueue`` + ``to_host`` of a trivial program, per backend.
3. Host/device overlap: a ~20 ms matmul program enqueued while the host runs
   ~20 ms of pure Python, per backend. Perfect overlap takes max(D, H), none D + H.
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.connection
import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from neuron_async_sm.runtime import DeviceFuture, DeviceRuntime, Program, TensorSpec, create_runtime
from neuron_async_sm.runtime.messages import WireTensor

TINY = TensorSpec((8,), torch.int32)


@dataclass(frozen=True)
class BenchPrograms:
    """``add_one`` for round trips; ``matmul`` repeats a [size, size] matmul ``iters`` times and
    returns the ``perf_counter`` stamps of its start and end."""

    size: int = 256

    def __call__(self, device: torch.device | None = None) -> Mapping[str, Program]:
        weight = torch.randn(self.size, self.size) / self.size**0.5  # [size, size]

        def matmul(x: torch.Tensor, iters: torch.Tensor) -> torch.Tensor:
            start = time.perf_counter()
            for _ in range(int(iters)):
                x = torch.tanh(x @ weight)  # [size, size]
            return torch.tensor([start, time.perf_counter()], dtype=torch.float64)  # [2] its own run

        return {"add_one": lambda x: x + 1, "matmul": matmul}


def _echo(conn: multiprocessing.connection.Connection) -> None:
    while (message := conn.recv()) is not None:
        conn.send(message)


def _median_us(run_once: Callable[[], object], iters: int) -> float:
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        run_once()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def wire_format_round_trips(iters: int) -> dict[str, float]:
    """Median µs for one echo round trip of int32[8] over a spawn pipe, per encoding."""
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    process = ctx.Process(target=_echo, args=(child_conn,), daemon=True)
    process.start()
    child_conn.close()
    tensor = torch.arange(8, dtype=torch.int32)
    encodings: dict[str, Callable[[], object]] = {
        "torch tensor (shared-memory reduction)": lambda: tensor,
        "numpy array": lambda: tensor.numpy(),
        "WireTensor (bytes)": lambda: WireTensor.encode(tensor),
    }
    results = {}
    for name, make in encodings.items():
        conn.send(make())
        conn.recv()  # warm-up
        results[name] = _median_us(lambda make=make: (conn.send(make()), conn.recv()), iters)
    conn.send(None)
    process.join()
    return results


def runtime_round_trip_us(runtime: DeviceRuntime, iters: int) -> float:
    x = torch.arange(8, dtype=torch.int32)  # [8]
    runtime.enqueue("add_one", {"x": x}, TINY).to_host()  # warm-up
    return _median_us(lambda: runtime.enqueue("add_one", {"x": x}, TINY).to_host(), iters)


def _python_work(seconds: float) -> int:
    """Pure-Python busy loop (holds the GIL), like the scheduler's bookkeeping."""
    deadline = time.perf_counter() + seconds
    count = 0
    while time.perf_counter() < deadline:
        count += sum(range(50))
    return count


@dataclass(frozen=True)
class Overlap:
    """Medians over repeated runs of: enqueue(matmul) → Python work → to_host."""

    device_s: float  # D: the program alone (wall time inside the device)
    host_s: float  # H: the Python work alone
    together_s: float  # wall time of the combined run; perfect overlap: max(D, H), none: D + H
    device_s_together: float  # D during the combined run: > device_s means CPU contention (cores, GIL)
    concurrent_fraction: float  # share of the device's run that fell inside the host's Python work

    @property
    def hidden_fraction(self) -> float:
        """1.0: the shorter phase is fully hidden behind the longer; 0.0: they serialize."""
        return (self.device_s + self.host_s - self.together_s) / min(self.device_s, self.host_s)


def measure_overlap(runtime: DeviceRuntime, size: int, target_s: float, repeats: int) -> Overlap:
    """Wall-clock overlap, plus a load-proof view: the program stamps its own start and end with
    ``time.perf_counter`` (CLOCK_MONOTONIC, shared by all processes), so the share of device
    execution that ran concurrently with the host's work is measured directly."""
    x = torch.randn(size, size)  # [size, size]
    stamps = TensorSpec((2,), torch.float64)

    def enqueue(iters: int) -> DeviceFuture:
        return runtime.enqueue("matmul", {"x": x, "iters": torch.tensor(iters)}, stamps)

    def device_only(iters: int) -> float:
        start, end = enqueue(iters).to_host().tolist()
        return end - start

    for _ in range(3):
        device_only(4)  # warm-up
    per_iter_s = statistics.median(device_only(10) for _ in range(5)) / 10
    iters = max(1, round(target_s / per_iter_s))
    device_s = statistics.median(device_only(iters) for _ in range(repeats))
    host_s = statistics.median(_timed(lambda: _python_work(target_s)) for _ in range(repeats))

    runs = []
    for _ in range(repeats):
        begin = time.perf_counter()
        future = enqueue(iters)
        host_start = time.perf_counter()
        _python_work(target_s)
        host_end = time.perf_counter()
        device_start, device_end = future.to_host().tolist()
        wall = time.perf_counter() - begin
        concurrent = max(0.0, min(host_end, device_end) - max(host_start, device_start))
        runs.append((wall, device_end - device_start, concurrent / (device_end - device_start)))
    together_s, device_s_together, concurrent_fraction = (statistics.median(r[i] for r in runs) for i in range(3))
    return Overlap(device_s, host_s, together_s, device_s_together, concurrent_fraction)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--iters", type=int, default=2000, help="round trips per measurement")
    parser.add_argument("--repeats", type=int, default=15, help="overlap repetitions")
    parser.add_argument("--size", type=int, default=256, help="matmul size")
    args = parser.parse_args()
    # The in-process device computes on this process's torch threads; match the device process.
    torch.set_num_threads(1)
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")

    print("raw spawn pipe, int32[8] echo round trip (median):")
    for name, us in wire_format_round_trips(args.iters).items():
        print(f"  {name:40s} {us:8.1f} µs")
    for device in ("cpu", "cpu-inprocess"):
        start = time.perf_counter()
        with create_runtime(device, BenchPrograms(args.size), num_threads=1) as runtime:
            startup = time.perf_counter() - start
            round_trip = runtime_round_trip_us(runtime, args.iters)
            overlap = measure_overlap(runtime, args.size, 0.020, args.repeats)
        print(f"device={device!r}: startup {startup:.2f} s, enqueue+to_host round trip {round_trip:.1f} µs")
        print(
            f"  overlap: D={overlap.device_s * 1e3:.1f} ms, H={overlap.host_s * 1e3:.1f} ms, "
            f"together={overlap.together_s * 1e3:.1f} ms (serial would be "
            f"{(overlap.device_s + overlap.host_s) * 1e3:.1f}); hidden {overlap.hidden_fraction:.0%}"
        )
        print(
            f"  D during the combined run {overlap.device_s_together * 1e3:.1f} ms, of which "
            f"{overlap.concurrent_fraction:.0%} ran concurrently with the host's Python work"
        )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
