"""Source-level mutants, as mutation-testing tools build them: a copy of the package with one exact
textual change, run in its own process. No hook in the engine, no method replaced at run time.

A test builds one with `mutant_package`, then starts the real CLI against it with `mutant_env` (the
copy first on PYTHONPATH; the device process, spawned from it, imports the same copy).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import neuron_async_sm

PACKAGE = Path(neuron_async_sm.__file__).resolve().parent


def mutant_package(root: Path, module: str, original: str, mutated: str) -> Path:
    """Copy the package under `root` with `original` replaced by `mutated` in `module` (a path inside the
    package, e.g. ``"worker/async_output.py"``); `original` must occur exactly once. Returns `root`."""
    copy = root / PACKAGE.name
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    path = copy / module
    source = path.read_text(encoding="utf-8")
    assert source.count(original) == 1, f"{module}: the mutated text occurs {source.count(original)} times, not once"
    path.write_text(source.replace(original, mutated), encoding="utf-8")
    return root


# The held-out write-back mutant: tokens addressed by the rows' current order, not by the step's snapshot
# (after a reorder a request's token lands in another request's state). model_check and the vLLM lane
# both run it and expect TokenOwnershipInv or NoStaleInputInv to reject its trace.
WRITE_BACK_BY_CURRENT_ROW = (
    "worker/input_batch.py",
    "            self.write_tokens(snapshot.req_ids, snapshot.sample_positions, tokens)\n",
    "            rows = self.req_ids[: len(snapshot.req_ids)]  # MUTANT: by current row\n"
    "            owners = rows + snapshot.req_ids[len(rows) :]\n"
    "            self.write_tokens(owners, snapshot.sample_positions, tokens)\n",
)

# get_output() without its lock: vLLM's (or our) output thread and the worker's main thread, breaking the
# async flow, may then both materialize one output. model_check and the vLLM lane expect its trace rejected.
NO_GET_OUTPUT_LOCK = (
    "worker/async_output.py",
    "self._lock = threading.Lock()",
    "self._lock = __import__('contextlib').nullcontext()  # MUTANT: no lock",
)


def mutant_env(root: Path) -> dict[str, str]:
    """This process's environment with the mutant package at `root` first on PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}


# Structured output's stale mask (the spec's MCMaskBeforeInFlightToken, run for real): a deferred step's
# mask is built before the step in flight is applied, i.e. from each grammar before its newest token.
MASK_BEFORE_IN_FLIGHT_TOKEN = (
    "engine/core.py",
    "        deltas = self._apply_oldest() if self.batch_queue else []\n"
    '        with self.tracer.observer.span("output"):  # host work of applying outputs\n'
    "            bitmask = self.scheduler.grammar_bitmask(launched.scheduled)\n",
    '        with self.tracer.observer.span("output"):  # MUTANT: before the step in flight is applied\n'
    "            bitmask = self.scheduler.grammar_bitmask(launched.scheduled)\n"
    "        deltas = self._apply_oldest() if self.batch_queue else []\n",
)

# The same stale mask under vLLM's engine core: its scheduler never marks a step as waiting for a
# grammar row's token in flight, so vLLM builds every mask at once, before applying the step in flight.
VLLM_MASK_BEFORE_IN_FLIGHT_TOKEN = (
    "vllm_plugin/engine_hooks.py",
    "        output = schedule(self, *args, **kwargs)\n",
    "        output = schedule(self, *args, **kwargs)\n"
    "        output.pending_structured_output_tokens = False  # MUTANT: every mask built at once\n",
)
