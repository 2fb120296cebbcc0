"""Speculative decoding under vLLM's scheduler through our plugin (the plugin lane).

One vLLM process runs one workload on five engines: n-gram (vLLM runs it synchronous: our worker's
drafts reach vLLM's scheduler through `take_draft_token_ids`, and come back scheduled), and
draft_model async on the uni-process and mp executors (vLLM sends `-1` placeholders and optimistic
computed counts; our runner feeds the drafts on the device, SpecSteady) and sync (the drafter's
drafts brought home, scheduled by vLLM, verified as sent), and async again with too few KV blocks
(vLLM preempts requests mid-run; they restart from their tokens). Greedy tokens equal our own
engine's without speculation (float64: verification over 1 + k positions is then greedy-stable),
with `max_tokens` and (draft_model) a stop token falling inside an accepted run (vLLM's scheduler
cuts the run: checked against the same prompt's uncut request's run from the same position); seeded
draft_model tokens are the same async and sync, and seeded n-gram tokens our engine's with n-gram
(our drafts, so our draws).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from spec_trace_check import check_spec_trace
from support.serve_harness import write_text_model
from support.vllm_harness import needs_vllm, run_case
from test_vllm_parity import same_logprobs, vllm_position
from test_vllm_trace import require_tlc
from trace_check import check_trace, read_trace

from neuron_async_sm import LLM, PromptRequest, SamplingParams
from neuron_async_sm.bench.checkpoint import write_noisy_copy

pytestmark = needs_vllm

K = 3
MAX_MODEL_LEN = 64
DRAFT_NOISE = 0.01  # the draft: the target's weights plus 1% of each one's std as noise (high acceptance)
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
LONG = [1, 5, 9, 13, 7, 20]  # its greedy output soon repeats (64-token vocabulary): drafts are accepted
# max_tokens of LONG's copies: some fall inside a draft_model run (its drafts are accepted from the
# start), some inside an n-gram one (its lookups find LONG's repeats from output 16 on)
CUT_MAX_TOKENS = (11, 12, 22, 27)
SEEDED = {"max_tokens": 20, "temperature": 0.8, "seed": 5}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, str]:
    """A random Llama with a tokenizer (vLLM reads both), and its noisy copy as the draft."""
    root = tmp_path_factory.mktemp("spec")
    target = write_text_model(root / "target", model_type="llama", torch_dtype="float32")
    draft = write_noisy_copy(target, root / "draft", DRAFT_NOISE)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target / name, draft / name)
    return str(target), str(draft)


def ours(ckpt: str, workload: list[dict], **config: object) -> dict[str, dict]:
    """Our own engine on the same requests (float64, as vLLM's runs)."""
    requests = [
        PromptRequest(w["prompt"], SamplingParams(**{"ignore_eos": True, **w["params"]}), w["id"]) for w in workload
    ]
    with LLM(
        ckpt, device="cpu-inprocess", max_num_seqs=8, max_model_len=MAX_MODEL_LEN, dtype="float64", **config
    ) as llm:
        outputs = llm.generate(requests)
    return {
        o.request_id: {
            "tokens": list(o.output_token_ids),
            "finish_reason": o.finish_reason,
            "logprobs": None if o.logprobs is None else [vllm_position(p) for p in o.logprobs],
        }
        for o in outputs
    }


def workload(ckpt: str) -> list[dict]:
    """LONG uncut, its copies cut by max_tokens and by a stop token (a token its greedy output first
    gives at output 9 or later), another greedy prompt, one asking for logprobs, and a seeded one."""
    (long,) = ours(ckpt, [{"id": "long", "prompt": LONG, "params": {"max_tokens": 40}}]).values()
    tokens = long["tokens"]
    at = next(j for j in range(9, len(tokens)) if tokens[j] not in tokens[:j])
    return [
        {"id": "long", "prompt": LONG, "params": {"max_tokens": 40}},
        *({"id": f"max-{m}", "prompt": LONG, "params": {"max_tokens": m}} for m in CUT_MAX_TOKENS),
        {"id": "stop", "prompt": LONG, "params": {"max_tokens": 40, "stop_token_ids": [tokens[at]]}},
        {"id": "other", "prompt": [1, 8, 8, 30, 31], "params": {"max_tokens": 30}},
        {"id": "logprobs", "prompt": [1, 12, 13, 12, 13], "params": {"max_tokens": 16, "logprobs": 2}},
        {"id": "seeded", "prompt": [1, 40, 41, 9], "params": SEEDED},
    ]


def cut_inside_a_run(outputs: dict, req_id: str) -> bool:
    """Did `req_id` end in a step whose run vLLM's scheduler cut? Greedy runs are a function of the
    position (the drafts of a history, and which of them the target accepts), so LONG's uncut request
    ran a step from the same position as `req_id`'s last step: that step gave it more tokens. Compared by
    position, not by step number: vLLM's engine core may take the requests in over several steps."""
    runs, before = {}, 0  # position a step started at -> tokens after it, for LONG
    for _, count in outputs["long"]["counts"]:
        runs[before], before = count, count
    counts = outputs[req_id]["counts"]
    start, final = (counts[-2][1] if len(counts) > 1 else 0), counts[-1][1]
    return runs.get(start, 0) > final


RUNS = [
    {"name": "ngram-sync", "async": False, "backend": "uni", "speculative": "ngram"},
    {"name": "draft-async", "async": True, "backend": "uni", "speculative": "draft_model"},
    {"name": "draft-sync", "async": False, "backend": "uni", "speculative": "draft_model"},
    {"name": "draft-async-mp", "async": True, "backend": "mp", "speculative": "draft_model"},
    # too few KV blocks for every request: vLLM preempts some mid-run, and they restart from their tokens
    {
        "name": "draft-async-preempted",
        "async": True,
        "backend": "uni",
        "speculative": "draft_model",
        "num_gpu_blocks": 14,
    },
]


# A traced run's own workload, small enough for TLC: two greedy requests (one stops at a token inside a
# run) and a seeded one arriving later.
TRACED = [
    {"id": "a", "prompt": LONG, "params": {"max_tokens": 9}},
    {"id": "b", "prompt": [1, 8, 8, 30, 31], "params": {"max_tokens": 6, "stop_token_ids": [54]}},
    {"id": "c", "prompt": [1, 40, 41, 9], "params": {"max_tokens": 5, "temperature": 0.8, "seed": 5}, "arrival": 2},
]


@pytest.fixture(scope="module")
def under_vllm(checkpoints, tmp_path_factory) -> tuple[list[dict], dict, Path]:
    """The workload, and what one vLLM process gave: RUNS' outputs and counters, a traced draft_model
    async run of TRACED (mp executor), and the refusals of what speculation cannot run (configurations
    built as vLLM builds them, and a request); and the trace's path."""
    target, draft = checkpoints
    items = workload(target)
    methods = {"ngram": NGRAM, "draft_model": {"method": "draft_model", "num_speculative_tokens": K, "model": draft}}
    common = {"dtype": "float64", "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 8}
    runs = [run | common | {"speculative_config": methods[run["speculative"]]} for run in RUNS]
    tmp_path = tmp_path_factory.mktemp("under-vllm")
    trace = tmp_path / "draft-async-traced.ndjson"
    traced = {
        "name": "traced",
        "async": True,
        "backend": "mp",
        "workload": TRACED,
        "options": {"trace_path": str(trace)},
    }
    runs.append(traced | common | {"speculative_config": methods["draft_model"]})
    refusals = {
        "configs": {
            "ngram_gpu": {"speculative_config": {"method": "ngram_gpu", "num_speculative_tokens": K}},
            "tp2": {"speculative_config": NGRAM, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
            "accepted": {"speculative_config": methods["draft_model"]},
        },
        "request": {"max_tokens": 8, "structured_outputs": {"json": {"type": "object"}}},
    }
    result = run_case(tmp_path, "runs", {"ckpt": target, "workload": items, "runs": runs, "refusals": refusals})
    return items, result.data, trace


def test_speculation_under_vllm_gives_our_tokens_async_and_sync(checkpoints, under_vllm):
    target, _ = checkpoints
    items, data, _ = under_vllm

    greedy = ours(target, items)
    seeded_ngram = ours(target, items, async_scheduling=False, speculative_config=NGRAM)["seeded"]
    for run in RUNS:
        name, got = run["name"], data[run["name"]]
        outputs, (stats,) = got["outputs"], got["stats"]
        print(name, f"start {got['start_s']:.1f} s, run {got['run_s']:.2f} s", stats)
        for item in items:
            req_id, out = item["id"], outputs[item["id"]]
            assert out["finished"], (name, req_id)
            if req_id != "seeded":
                want = greedy[req_id]
                assert (out["tokens"], out["finish_reason"]) == (want["tokens"], want["finish_reason"]), (name, req_id)
                # each token of a run with its own position's logprobs (vLLM slices them per request)
                same_logprobs(out["logprobs"], want["logprobs"], f"{name} {req_id} logprobs")
        if "num_gpu_blocks" in run:  # restarts run other steps than LONG's uncut copy: no cut to compare
            assert stats["restarts"] > 0, stats
        else:  # the cuts fell inside accepted runs, as placed: vLLM's scheduler dropped the run's tail
            counts = f"{name}: long {outputs['long']['counts']}"
            assert any(cut_inside_a_run(outputs, f"max-{m}") for m in CUT_MAX_TOKENS), counts
            # The stop token is one LONG's output had not given before; an n-gram draft is a token the
            # history holds, so under n-gram such a token can only end a run, never fall inside one.
            if run["speculative"] == "draft_model":
                assert cut_inside_a_run(outputs, "stop"), f"{counts}, stop {outputs['stop']['counts']}"
        # drafts were accepted: some step gave a request more than one token
        assert stats["num_draft_tokens"] > 0 and stats["num_spec_rows"] > 0, stats
        runs_of = [
            b - a for r in outputs.values() for (_, a), (_, b) in zip(r["counts"], r["counts"][1:], strict=False)
        ]
        assert max(runs_of) > 1, name
        assert stats["outputs_materialized"] == stats["outputs_created"], stats  # each output once
        if run["async"]:  # the device fed the drafts: vLLM's placeholders never reached a program
            assert stats["state_counts"]["SpecSteady"] > 0 and stats["overlapped_steps"] > 0, stats
    seeded = {run["name"]: data[run["name"]]["outputs"]["seeded"]["tokens"] for run in RUNS}
    # Not the preempted run: its restart samples the first token after the preemption in a prompt's row
    # (the ordinary sampler at that output index) where the others verified a draft there (rejection
    # sampling): the same distribution, another draw.
    assert seeded["draft-async"] == seeded["draft-sync"] == seeded["draft-async-mp"], seeded
    # vLLM's n-gram run verified our worker's drafts: our engine's with n-gram draws the same tokens
    assert seeded["ngram-sync"] == seeded_ngram["tokens"], (seeded, seeded_ngram)


def test_what_speculation_cannot_run_under_vllm_is_refused_by_name(under_vllm):
    errors = under_vllm[1]["refusals"]
    print(errors)
    assert "speculative_config.method: 'ngram_gpu' is not supported" in errors["ngram_gpu"], errors
    assert "speculative_config with tensor_parallel_size > 1 is not supported" in errors["tp2"], errors
    assert errors["accepted"] is None, errors
    assert "structured_outputs is not supported with speculative_config (method 'draft_model')" in errors["request"]


def test_a_traced_draft_model_run_under_vllm_is_a_behaviour_of_both_specs(under_vllm):
    """The trace of a draft_model async run under vLLM's engine core (mp executor): its machine rows are
    AsyncScheduling.tla's and its runs SpecDecode.tla's (each client gets each accepted token once, in
    order, nothing after a stop; placeholders reconciled), with what each request got per step from
    vLLM's scheduler (engine_hooks.py's AdvanceStep `counts`). The same trace claiming that every
    request got one token per step (what the hooks recorded before they counted) is rejected."""
    require_tlc()
    _, data, trace = under_vllm
    events = read_trace(trace)
    assert data["traced"]["stats"][0]["state_counts"]["SpecSteady"] > 0
    verdict = check_trace(events)
    print("AsyncScheduling:", verdict.describe())
    assert verdict.accepted, verdict.describe()
    runs = check_spec_trace(events)
    print("SpecDecode:", runs.describe())
    assert runs.accepted, runs.describe()
    steps = [e for e in events if e["event"] == "AdvanceStep"]
    assert any(n > 1 for e in steps for n in e["counts"]), steps  # a run of accepted drafts reached a client
    ones = [{**e, "counts": [1] * len(e["counts"])} if e["event"] == "AdvanceStep" else e for e in events]
    wrong = check_spec_trace(ones)
    print("SpecDecode, one token per step:", wrong.describe())
    assert not wrong.accepted and wrong.rejected_event["event"] == "AdvanceStep", wrong.describe()
