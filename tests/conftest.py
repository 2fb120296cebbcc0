"""Hypothesis profiles (docs/testing.md): `dev` (local default), `ci` (default when CI=true), `thorough`.

Pick one with HYPOTHESIS_PROFILE=ci|dev|thorough. Stateful tests scale their example counts from the
loaded profile's `max_examples`, so one knob sizes the whole run.
"""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import HealthCheck, settings

_COMMON = dict(
    deadline=None,  # a step of the real engine waits on threads and a device process: timing varies
    print_blob=True,  # a failure prints the blob that replays it (@reproduce_failure)
    suppress_health_check=[HealthCheck.too_slow],  # the engine is slow on purpose; a too-slow draw is not a bug
)
# ci is derandomized like hypothesis's own built-in CI profile (which this one replaces): CI runs the
# same examples every time, so a red CI is about the change, not the luck of the draw. dev and
# thorough draw new examples each run; they are the ones that explore.
settings.register_profile("dev", max_examples=40, stateful_step_count=30, derandomize=False, **_COMMON)
settings.register_profile("ci", max_examples=300, stateful_step_count=40, derandomize=True, database=None, **_COMMON)
settings.register_profile("thorough", max_examples=2_000, stateful_step_count=100, derandomize=False, **_COMMON)

PROFILE = os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI", "").lower() in ("1", "true") else "dev")
settings.load_profile(PROFILE)


def pytest_report_header(config) -> str:
    return (
        f"hypothesis profile: {PROFILE} ({settings.default.max_examples} examples, "
        f"{settings.default.stateful_step_count} steps)"
    )


SOAK_REQUESTS = {"dev": 1_000, "ci": 4_000, "thorough": 40_000}


@pytest.fixture(scope="session")
def soak_requests() -> int:
    """How many requests tests/test_soak.py pushes through the engine under the loaded profile."""
    return SOAK_REQUESTS.get(PROFILE, SOAK_REQUESTS["ci"])


def pytest_terminal_summary(terminalreporter) -> None:
    """One line per stateful suite that ran: examples, engine steps, invariant checks, paths reached."""
    for module_name, attr in (("test_stateful_engine", "COVERAGE"), ("test_stateful_machine", "RUNS")):
        counts = getattr(sys.modules.get(module_name), attr, None)
        if counts:
            terminalreporter.write_line(f"{module_name}: {dict(counts)}")
