"""Fixtures for the TLC checks. Without Java the checks skip with the reason, unless CI demands them."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

# tlc.py, trace_check.py (this folder) and support.* (tests/) are on the path through pytest's `pythonpath`.
from tlc import PARALLEL_RUNS, REQUIRE_ENV, SHORT_RUN_STATES, TlcResult, manifest_models, missing_reason, run_tlc


@pytest.fixture(scope="session")
def tlc_available() -> None:
    """Skip (or, with NEURON_ASYNC_SM_REQUIRE_TLC=1, fail) when TLC cannot run here."""
    reason = missing_reason()
    if reason is None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but {reason}")
    pytest.skip(f"{reason} (set {REQUIRE_ENV}=1 to make this a failure)")


@pytest.fixture(scope="session")
def model_results(tlc_available, tmp_path_factory) -> dict[str, TlcResult]:
    """Every manifest model's TLC result, by config file, two runs at a time. A model marked
    `"dump": "dot"` also writes its state graph, with action labels, to `result.dot_path`."""
    dumps = tmp_path_factory.mktemp("tlc-dumps")

    def run(entry: dict) -> TlcResult:
        dot = dumps / (Path(entry["config"]).stem + ".dot") if entry.get("dump") == "dot" else None
        short = entry["distinct_states"] < SHORT_RUN_STATES
        return run_tlc(entry["module"], entry["config"], dump_dot=dot, short=short)

    models = manifest_models()
    with ThreadPoolExecutor(PARALLEL_RUNS) as pool:
        return dict(zip([m["config"] for m in models], pool.map(run, models), strict=True))
