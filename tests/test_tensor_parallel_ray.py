"""Tensor parallelism on Ray (`--distributed-executor-backend ray`): each rank's device process is a
Ray actor in a placement group, on a local Ray instance of this machine's CPUs (the `ray` extra).

The same checks as the multiprocessing backend (tests/test_tensor_parallel.py), on real actors; the
CLI run on Ray is in that file, beside the TP=1 run it compares with. Speculation with a draft model
split over the actors is tests/test_spec_decode_tp.py's check (its k = 3), run here on this module's
Ray instance rather than starting one there.
"""

from __future__ import annotations

import pytest
from support.workloads import SPEC_ENGINE
from test_spec_decode import target  # noqa: F401
from test_spec_decode_tp import check_draft_tp2, draft_churn  # noqa: F401
from test_spec_draft_model import close_draft, draft_model  # noqa: F401
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


def test_ray_tp2_with_a_draft_model_gives_tp1_tokens_without(target, close_draft, draft_churn):  # noqa: F811
    """The draft split over the two actors as the target is (k = 3, async: test_spec_decode_tp's k = 3):
    the TP=1 tokens without speculation, each rank feeding its own next_input, permuted or not."""
    spec = draft_model(close_draft, 3)
    with LLM(
        target, tensor_parallel_size=2, distributed_executor_backend="ray", speculative_config=spec, **SPEC_ENGINE
    ) as llm:
        check_draft_tp2(llm, draft_churn)


def test_ray_killed_rank_ends_the_engine_naming_the_rank():
    llm = LLM("tiny-llama", tensor_parallel_size=2, distributed_executor_backend="ray", device_timeout_s=30)
    pid = llm.engine.runtimes[1].device_pid
    kill_rank_one(llm, f"device actor (process {pid} on ")
