"""Scripted scenarios: the path each step takes, and the counters, match the design step by step.

With `--no-async-relay` every scenario takes the design's paths, counter for counter; with the relay
on, each step the design breaks, rebuilds or remaps is a Relay instead."""

from __future__ import annotations

import json

import pytest

from neuron_async_sm import LLM, PromptRequest, SamplingParams

S, NP, CB, SM, RR = "Steady", "NoPendingFuture", "CompositionBreak", "ShapeMismatchRebuild", "ReorderRemap"
R = "Relay"
HD = "HostDraftBreak"  # n-gram speculation's row: counted, never taken here
SS, SX = "SpecSteady", "SpecExit"  # draft_model speculation's rows: counted, never taken here
PATHS = (NP, R, CB, SM, RR, S, HD, SS, SX)


def run(tmp_path, requests, **config):
    trace = tmp_path / "trace.ndjson"
    config.setdefault("device", "cpu-inprocess")
    with LLM("tiny-llama", dtype="float64", trace_path=str(trace), **config) as llm:
        outputs = llm.generate(requests)
        stats = llm.stats()
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    return [e["state"] for e in events if e["event"] == "step"], outputs, stats


def req(rid, prompt_len, max_tokens, arrival=0):
    prompt = [3 + (i * 7 + len(rid)) % 900 for i in range(prompt_len)]
    return PromptRequest(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), rid, arrival)


SCENARIOS = {
    # One request, prompt 8, buckets (4, 8): prefill with nothing pending; the first decode's future is
    # [1] (prefill rows are not padded) against a padded [4] input; then steady decode.
    "single request": ([req("a", 8, 10)], {"decode_buckets": (4, 8)}, [NP, SM] + [S] * 8),
    # Four requests fill bucket 4, so the first decode already matches. b reaches max_tokens one step
    # ahead: it is not scheduled (CompositionBreak); then it is removed and condense() moves d into its
    # row: same set {a, c, d}, new order (ReorderRemap).
    "finish and condense": (
        [req("a", 4, 8), req("b", 4, 3), req("c", 4, 8), req("d", 4, 8)],
        {"decode_buckets": (4, 8)},
        [NP, S, S, CB, RR, S, S, S],
    ),
    # b joins while a decodes: a mixed prefill step (CompositionBreak), then [2] rows into bucket 4.
    "join mid-run": (
        [req("a", 4, 8), req("b", 4, 4, arrival=3)],
        {"decode_buckets": (4, 8)},
        [NP, SM, S, CB, SM, S, S, CB],  # a's last step runs alone: b left one step early
    ),
    # A 40-token prompt under a 16-token budget: three chunks. The same set continues in prefill,
    # whose 2-D input can never take the future: materialize and build on the CPU.
    "chunked prefill": (
        [req("a", 40, 4)],
        {"max_num_batched_tokens": 16, "prefill_buckets": (16,), "decode_buckets": (1, 2, 4, 8)},
        [NP, SM, SM, S, S, S],
    ),
}


# Where the relay on takes other paths than the design's with every fallback relayed: the relay also
# releases a KV slot one step early (scheduler._release_slot), so the worker drops b in the step that
# leaves it out and condense() moves d there; the next step keeps the order: Steady, not a remap.
RELAY_PATHS = {"finish and condense": [NP, S, S, R, S, S, S, S]}


def relayed(name: str, paths: list[str]) -> list[str]:
    """The paths with the relay on: every break, rebuild and remap relays (unless RELAY_PATHS says)."""
    return RELAY_PATHS.get(name, [R if p in (CB, SM, RR) else p for p in paths])


@pytest.mark.parametrize("relay", [False, True], ids=["no-relay", "relay"])
@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_paths_and_counters(tmp_path, name, relay):
    requests, config, design = SCENARIOS[name]
    expected = relayed(name, design) if relay else design
    paths, outputs, stats = run(tmp_path, requests, async_relay=relay, **config)
    assert paths == expected
    async_steps = expected.count(S) + expected.count(R)
    assert stats["async_steps"] == async_steps
    assert stats["sync_fallback_steps"] == len(expected) - async_steps
    assert stats["state_counts"] == {s: expected.count(s) for s in PATHS}
    assert [len(o.output_token_ids) for o in outputs] == [r.sampling_params.max_tokens for r in requests]
