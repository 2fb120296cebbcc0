"""docs/bench/tree_ab.py, the A/B of a bench command between two trees: it runs the real bench in each
tree, alternating, refuses a tree it would not really import, and reads every section a report has.

Nothing here compares timings: both sides are this tree."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import tree_ab  # tools/ (pytest's pythonpath)

REPO = Path(__file__).resolve().parents[1]
TINY = ["--workload", "steady", "--num-requests", "2", "--output-tokens", "4"]
TINY += ["--repetitions", "1", "--warmup", "0", "--no-progress"]


def test_each_tree_runs_the_bench_and_the_medians_are_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "ab.json"
    doc = tree_ab.main(["--before", str(REPO), "--after", str(REPO), "--cycles", "1", "--out", str(out), "--", *TINY])
    assert doc["bench_args"] == TINY and out.exists()
    for name in ("before", "after"):
        [run] = doc["runs"][name]
        assert doc["medians"][name] == run
        for key in ("sync_tokens_per_s", "async_tokens_per_s", "speedup", "ideal_speedup", "async_step_fraction"):
            assert math.isfinite(run[key]) and run[key] > 0, (name, key)


def test_the_trees_alternate_abba() -> None:
    assert [tree_ab.order(c) for c in range(4)] == [("before", "after"), ("after", "before")] * 2


def test_a_tree_that_does_not_provide_the_package_is_refused(tmp_path: Path) -> None:
    # An empty directory on PYTHONPATH: the package would come from the editable install instead.
    with pytest.raises(SystemExit, match="not this tree"):
        tree_ab.main(["--before", str(REPO), "--after", str(tmp_path), "--", *TINY])
