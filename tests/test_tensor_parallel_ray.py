"""Tensor parallelism on Ray (`--distributed-executor-backend ray`): each rank's device process is a
Ray actor in a placement group, on a local Ray instance of this machine's CPUs (the `ray` extra).

The same checks as the multiprocessing backend (tests/test_tensor_parallel.py), on real actors; the
CLI run on Ray is in that file, beside the TP=1 run it compares with.
"""

from __future__ import annotations

import pytest
from test_tensor_parallel import ENGINE, check_churn, kill_rank_one, reference  # noqa: F401

from neuron_async_sm import LLM

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """One local Ray instance for this module's engines, shut down after it (its daemons with it)."""
    yield
    ray.shutdown()


@pytest.mark.parametrize("mode", [dict(async_scheduling=False), dict(async_relay=True)], ids=["sync", "relay"])
def test_ray_tp2_gives_tp1_tokens_on_churn(reference, mode):  # noqa: F811
    with LLM("tiny-llama", tensor_parallel_size=2, distributed_executor_backend="ray", **mode, **ENGINE) as llm:
        check_churn(llm, reference, mode)


def test_ray_killed_rank_ends_the_engine_naming_the_rank():
    llm = LLM("tiny-llama", tensor_parallel_size=2, distributed_executor_backend="ray", device_timeout_s=30)
    pid = llm.engine.runtimes[1].device_pid
    kill_rank_one(llm, f"device actor (process {pid} on ")
