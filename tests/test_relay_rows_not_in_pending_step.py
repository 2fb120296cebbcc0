"""A Relay step feeds a decode row that was not in the pending step from its CPU-built id.

vLLM's scheduler leaves a running decode out of a step (the token budget spent before its turn, a
request preempted and resumed) and runs it again later; our scheduler never does (every running
decode is scheduled on every step until its last token is in flight), so no engine run of ours
builds that step. Here the step sequence is built by hand and run through real ModelRunners (the
worker's public surface: execute_model, sample_tokens, get_output) on the engine's programs: three
requests join, then decode in turns, each sitting out one step or more. A decode row whose request
did not sample in the pending step must take the token the host already has (its step was applied
before this one was scheduled), never a row of the pending future, never POISON_TOKEN. Every runner
(sync, async with the relay on and off) must sample what each request samples alone.

The same steps also reach a guard of the CPU-built ids: step 2's rows start at exactly the positions
step 1's rows sampled, but they are other requests; the ids step 1 wrote back are not theirs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from neuron_async_sm import LLM, SamplingParams
from neuron_async_sm.outputs import ModelRunnerOutput, NewRequestData, SchedulerOutput
from neuron_async_sm.trace import Tracer
from neuron_async_sm.worker.model_runner import ModelRunner

ENGINE = dict(
    dtype="float64",  # batch-invariant: a row's token does not depend on its neighbours
    max_num_seqs=4,
    max_model_len=32,
    max_num_batched_tokens=16,
    prefill_buckets=(8, 16),
    decode_buckets=(1, 2, 4),
)
# r0 and r1 the same length and r2 one longer: step 2 starts where step 1 sampled (see the docstring)
PROMPTS = {"r0": [5, 9, 17], "r1": [30, 2, 19], "r2": [7, 7, 8, 11], "r3": [40, 41]}
SEEDS = {"r0": 11, "r1": 12, "r2": 13, "r3": 14}
# Greedy rows follow their input token closely; sampled ones test the seed and output index as well.
TEMPERATURE = {"r0": 0.0, "r1": 1.0, "r2": 0.0, "r3": 1.0}
# Per step: the requests it runs, in row order; a request's first step is its prefill.
STEPS = [
    ["r0", "r1", "r2"],  # NoPendingFuture: three prefills
    ["r0", "r1"],  # r2 sits out
    ["r1", "r2"],  # r2 was not in the pending step: its CPU-built id; starts at step 1's sampled positions
    ["r0", "r1", "r2"],  # r0 was not in the pending step
    ["r2"],
    ["r0", "r2", "r3"],  # r0 was not in the pending step, beside a prefill (a mixed step)
    ["r0", "r1", "r2", "r3"],  # r1 was not in the pending step
]


def params_of(request: str, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=TEMPERATURE[request], seed=SEEDS[request], ignore_eos=True)


@dataclass
class HandScheduler:
    """Builds the SchedulerOutputs of STEPS the way Scheduler.schedule() would, KV slots in join order."""

    outputs: dict[str, int] = field(default_factory=dict)  # request -> tokens sampled so far

    def schedule(self, step_id: int, rows: list[str]) -> SchedulerOutput:
        new = [r for r in rows if r not in self.outputs]
        num_scheduled, num_computed = {}, {}
        for r in rows:
            joins = r in new
            num_scheduled[r] = len(PROMPTS[r]) if joins else 1
            num_computed[r] = 0 if joins else len(PROMPTS[r]) + self.outputs[r] - 1
            self.outputs[r] = self.outputs.get(r, 0) + 1
        params = {r: params_of(r, 16) for r in new}
        slots = {r: int(r[1:]) for r in new}
        return SchedulerOutput(
            step_id=step_id,
            num_scheduled_tokens=num_scheduled,
            num_computed_tokens=num_computed,
            scheduled_new_reqs=[NewRequestData(r, PROMPTS[r], params[r], SEEDS[r], slots[r]) for r in new],
            finished_req_ids=frozenset(),
            sampling_req_ids=frozenset(rows),
            all_decode=not new,
        )


def run_steps(llm: LLM, trace_path: Path | None = None) -> list[dict[str, int]]:
    """STEPS through a fresh ModelRunner on `llm`'s device; each step's tokens by request.

    In async mode the outputs are materialized as the engine core does it: step k's before step k+2
    is enqueued (the batch queue holds two steps), on this thread here."""
    tracer = Tracer(str(trace_path) if trace_path else None)
    runner = ModelRunner(llm.config, llm.engine.runtime, vocab_size=llm.vocab_size, tracer=tracer)
    scheduler = HandScheduler()
    pending, results = [], []
    try:
        for step_id, rows in enumerate(STEPS):
            runner.execute_model(scheduler.schedule(step_id, rows))
            output = runner.sample_tokens()
            if isinstance(output, ModelRunnerOutput):  # sync: already on the host
                results.append(output.by_request())
                continue
            pending.append(output)
            if len(pending) == 2:
                results.append(pending.pop(0).get_output().by_request())
        results += [output.get_output().by_request() for output in pending]
    finally:
        tracer.close()
    return results


@pytest.fixture(scope="module")
def expected() -> list[dict[str, int]]:
    """Each step's tokens by request, from each request decoded alone by the sync engine: sampling is
    a pure function of the logits, the seed and the output index, and float64 is batch-invariant."""
    counts = {r: sum(r in step for step in STEPS) for r in PROMPTS}
    with LLM("tiny-llama", async_scheduling=False, device="cpu-inprocess", **ENGINE) as llm:
        alone = {r: llm.generate([PROMPTS[r]], params_of(r, counts[r]))[0].output_token_ids for r in PROMPTS}
    return [{r: alone[r][sum(r in step for step in STEPS[:k])] for r in rows} for k, rows in enumerate(STEPS)]


def test_the_sync_runner_on_these_steps_samples_what_each_request_samples_alone(expected):
    with LLM("tiny-llama", async_scheduling=False, device="cpu-inprocess", **ENGINE) as llm:
        assert run_steps(llm) == expected


@pytest.mark.parametrize("device", ["cpu-inprocess", "cpu"])  # the device process: the map crosses the wire
def test_a_relay_feeds_rows_absent_from_the_pending_step_the_host_token(expected, tmp_path, device):
    path = tmp_path / "relay.ndjson"
    with LLM("tiny-llama", async_scheduling=True, async_relay=True, device=device, **ENGINE) as llm:
        tokens = run_steps(llm, path)
    assert tokens == expected  # step by step: what each request samples alone, so what sync samples

    events = [json.loads(line) for line in path.read_text().splitlines()]
    reinstates = {e["step"]: e for e in events if e["event"] == "reinstate"}
    last_token: dict[str, tuple[int, int]] = {}  # request -> (its newest token, that token's position)
    checked = 0
    for step_id, rows in enumerate(STEPS):
        e = reinstates[step_id]
        assert e["req_ids"] == rows
        if step_id > 0:
            assert e["source"] == "Relay", e
            previous = STEPS[step_id - 1]
            for i, r in enumerate(rows):
                if r in previous:  # sampled in the pending step: relayed from its row there
                    assert e["relay_from"][i] == previous.index(r) and e["inputs"][i] == ["future", previous.index(r)]
                elif r in last_token:  # a decode that sat out: the host's token, at its position
                    token, position = last_token[r]
                    assert e["relay_from"][i] == -1, (step_id, r, e)
                    assert e["inputs"][i] == ["host", token, position], (step_id, r, e)
                    checked += 1
        for r in rows:
            position = len(PROMPTS[r]) + sum(r in step for step in STEPS[:step_id])
            last_token[r] = (expected[step_id][r], position)
    assert checked == 4  # steps 2, 3, 5 and 6 each have one such row


def test_the_relay_off_takes_the_fallbacks_on_the_same_steps_and_agrees(expected):
    with LLM("tiny-llama", async_scheduling=True, async_relay=False, device="cpu-inprocess", **ENGINE) as llm:
        assert run_steps(llm) == expected
