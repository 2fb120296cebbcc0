"""The device library's own count of its work (XLA's debug metrics), to check a runtime against it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from neuron_async_sm.runtime import DeviceRuntime


def device_work(device: str) -> tuple[int, int] | None:
    """(graphs executed, device->host transfers) as torch_xla counts them; None on a device without
    such counters."""
    if device != "xla":
        return None
    import torch_xla.debug.metrics as metrics

    counts = [metrics.metric_data(name) for name in ("ExecuteTime", "TransferFromDeviceTime")]
    return 0 if counts[0] is None else int(counts[0][0]), 0 if counts[1] is None else int(counts[1][0])


@contextmanager
def one_graph_per_program(device: str, runtime: DeviceRuntime) -> Iterator[None]:
    """Asserts that the block ran each program as one graph and read each output back once: the graphs
    the device executed equal the programs completed, its transfers the runtime's (a program split by
    an op the device runs on the host executes two graphs with a read-back between them)."""
    before, stats = device_work(device), runtime.stats()
    yield
    after, now = device_work(device), runtime.stats()
    if before is None or after is None:
        return
    work = after[0] - before[0], after[1] - before[1]
    expected = now.programs_completed - stats.programs_completed, now.host_transfers - stats.host_transfers
    assert work == expected, f"(graphs, reads) {work}, expected one of each per program and read: {expected}"
