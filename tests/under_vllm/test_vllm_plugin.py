"""Our worker under vLLM 0.33's own engine, schedulers and executors (the plugin lane, .ci/vllm-lane).

Each case is a subprocess (tests/under_vllm/run_case.py) under a hard timeout. References come from our own
engine and from transformers on the same checkpoint, computed here.
"""

from __future__ import annotations

import pytest
import torch
from support.reference import hf_greedy
from support.serve_harness import write_text_model
from support.vllm_harness import OUR_PLATFORM, needs_vllm, run_case

from neuron_async_sm import LLM, PromptRequest, SamplingParams

pytestmark = needs_vllm

# Prompts of the 64-token text model (ids 3..63 are words); lengths 5 to 30.
PROMPTS = [[1, *[3 + (7 * i + 5 * k) % 61 for k in range(n - 1)]] for i, n in enumerate((5, 9, 17, 30))]
NEW_TOKENS = 12
S, NP, CB, SM, RR, R = "Steady", "NoPendingFuture", "CompositionBreak", "ShapeMismatchRebuild", "ReorderRemap", "Relay"
PATHS = (NP, R, CB, SM, RR, S, "HostDraftBreak", "SpecSteady", "SpecExit")  # the last three: speculation's


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    """A random Llama checkpoint with a tokenizer, readable by vLLM, transformers and our loader."""
    path = tmp_path_factory.mktemp("ckpt")
    write_text_model(path, model_type="llama", torch_dtype="float32")
    return str(path)


def item(req_id: str, prompt: list[int], max_tokens: int, **extra) -> dict:
    params = {
        "max_tokens": max_tokens,
        **{k: extra.pop(k) for k in ("temperature", "seed", "stop_token_ids") if k in extra},
    }
    return {"id": req_id, "prompt": prompt, "params": params, **extra}


def ours(ckpt: str, workload: list[dict], **config) -> dict[str, list[int]]:
    """Our engine's tokens for the workload's requests (all arriving at once), by request id."""
    requests = [
        PromptRequest(
            w["prompt"],
            SamplingParams(
                max_tokens=w["params"]["max_tokens"],
                temperature=w["params"].get("temperature", 0.0),
                seed=w["params"].get("seed"),
                stop_token_ids=w["params"].get("stop_token_ids", ()),
                ignore_eos=True,
            ),
            w["id"],
        )
        for w in workload
    ]
    with LLM(ckpt, device="cpu-inprocess", max_num_seqs=4, max_model_len=64, **config) as llm:
        return {o.request_id: list(o.output_token_ids) for o in llm.generate(requests)}


def transformers_greedy(ckpt: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    return [hf_greedy(model, prompt, new_tokens) for prompt in prompts]


def tokens_of(result: dict) -> dict[str, list[int]]:
    return {req_id: out["tokens"] for req_id, out in result["outputs"].items()}


# -- (a) activation -------------------------------------------------------------------------------


def test_the_plugin_is_active_only_where_vllm_plugins_names_it(tmp_path):
    named = run_case(tmp_path, "platform", {}, timeout_s=120)
    unset = run_case(tmp_path, "platform", {}, timeout_s=120, VLLM_PLUGINS=None)
    assert named.data == {"platform": OUR_PLATFORM, "out_of_tree": True}
    # Unset: vLLM loads every installed plugin and ours declines; this CUDA wheel on a CPU box then
    # resolves to no platform at all (not CpuPlatform).
    assert unset.data["platform"] != OUR_PLATFORM and not unset.data["out_of_tree"], unset.data


# -- (b) tokens: vLLM + our worker == our engine == transformers ---------------------------------


def test_greedy_tokens_equal_our_engine_and_transformers_async_and_sync_uni_and_mp(ckpt, tmp_path):
    workload = [item(str(i), prompt, NEW_TOKENS) for i, prompt in enumerate(PROMPTS)]
    runs = [
        {"name": f"{executor}-{'async' if is_async else 'sync'}", "async": is_async, "backend": executor}
        for executor in ("uni", "mp")
        for is_async in (True, False)
    ]
    result = run_case(tmp_path, "runs", {"ckpt": ckpt, "workload": workload, "runs": runs})
    reference = transformers_greedy(ckpt, PROMPTS, NEW_TOKENS)
    expected = {str(i): tokens for i, tokens in enumerate(reference)}
    assert ours(ckpt, workload) == expected, "our engine differs from transformers on this checkpoint"
    for run in runs:
        got = result.data[run["name"]]
        assert tokens_of(got) == expected, run["name"]
        (stats,) = got["stats"]
        assert stats["outputs_materialized"] == stats["outputs_created"] > 0, (run["name"], stats)
        if run["async"]:
            # vLLM's batch queue kept a step in flight: steps arrived before the previous step's output
            # was read (uni-process: every step after the first, the output is read only when the queue
            # is full; mp: the output thread reads it as soon as it is done, so some), and most steps
            # took our async paths.
            overlapped = stats["overlapped_steps"]
            assert overlapped == stats["outputs_created"] - 1 if run["backend"] == "uni" else overlapped >= 1, stats
            assert stats["async_steps"] > stats["sync_fallback_steps"], (run["name"], stats)
        print(run["name"], f"start {got['start_s']:.1f} s, run {got['run_s']:.2f} s", stats)


# -- (c) async == sync under churn, preemption forced ---------------------------------------------

CHURN_BLOCKS = 9  # vLLM's KV blocks of 16 positions (one held back): 8 x 16 = 128 positions for 4 slots of 64


def churn_workload(stop_token: int) -> list[dict]:
    """Arrivals over time, a stop token, an abort, seeded random sampling; long enough that four
    running requests outgrow CHURN_BLOCKS and vLLM preempts."""
    lengths = (6, 21, 12, 30, 9, 17, 25, 8)
    items = []
    for i, n in enumerate(lengths):
        prompt = [1, *[3 + (11 * i + 3 * k) % 61 for k in range(n - 1)]]
        extra: dict = {"arrival": (0, 0, 0, 2, 5, 9, 14, 20)[i]}
        if i not in (0, 4):
            extra.update(temperature=0.8, seed=100 + i)
        if i == 4:
            extra["stop_token_ids"] = [stop_token]
        if i == 5:
            extra["abort"] = 12
        items.append(item(f"r{i}", prompt, 24 + (i % 3) * 4, **extra))
    return items


def check_churn(result: dict, workload: list[dict], expected: dict[str, list[int]]) -> None:
    for w in workload:
        got = result["outputs"][w["id"]]
        if w.get("abort") is not None:
            assert got["finish_reason"] == "abort", got
            assert got["tokens"] == expected[w["id"]][: len(got["tokens"])], w["id"]
        else:
            assert got["tokens"] == expected[w["id"]], w["id"]


@pytest.mark.parametrize("runner", ["v1", "v2"], ids=["model-runner-v1", "model-runner-v2"])
def test_async_equals_sync_under_churn_and_preemption(ckpt, tmp_path, runner):
    probe = ours(ckpt, [item("p", [1, 3, 14, 25, 36, 47, 58, 8, 19], 24)], dtype="float64")["p"]
    workload = churn_workload(stop_token=probe[5])
    workload[4]["prompt"] = [1, 3, 14, 25, 36, 47, 58, 8, 19]  # r4 stops at its sixth token
    expected = ours(ckpt, workload, dtype="float64", async_scheduling=False)
    assert len(expected["r4"]) == 6 and expected["r4"][-1] == probe[5]
    common = {"dtype": "float64", "max_num_batched_tokens": 16, "num_gpu_blocks": CHURN_BLOCKS}
    runs = [{"name": mode, "async": mode == "async", **common} for mode in ("async", "sync")]
    result = run_case(
        tmp_path,
        "runs",
        {"ckpt": ckpt, "workload": workload, "runs": runs},
        VLLM_USE_V2_MODEL_RUNNER="1" if runner == "v2" else "0",
    )
    for run in runs:
        got = result.data[run["name"]]
        check_churn(got, workload, expected)
        (stats,) = got["stats"]
        assert stats["restarts"] > 0, f"{run['name']}: vLLM never preempted: {stats}"
        print(runner, run["name"], f"start {got['start_s']:.1f} s, run {got['run_s']:.2f} s", stats)
    assert tokens_of(result.data["async"]) == tokens_of(result.data["sync"])


# -- (d) the seed's scenario counters under vLLM --------------------------------------------------

SCENARIOS = {
    # One request, prompt 8, decode buckets (4, 8): the prefill with nothing pending, then the first
    # decode's future is [1] (a prefill's rows are not padded) against a padded [4] input: one fallback
    # (the design's ShapeMismatchRebuild; the relay's Relay), then Steady.
    "single request": (
        [item("a", [1, *range(10, 17)], 10)],
        {"decode_buckets": [4, 8]},
        {False: [NP, SM] + [S] * 8, True: [NP, R] + [S] * 8},
    ),
    # A 40-token prompt under a 16-token budget: three chunks; a prompt chunk never takes the future.
    "chunked prefill": (
        [item("a", [1, *(3 + k % 60 for k in range(39))], 4)],
        {"prefill_buckets": [16], "decode_buckets": [1, 2, 4, 8]},
        {False: [NP, SM, SM, S, S, S]},
    ),
}


def test_the_seeds_scenario_counters_hold_under_vllm(ckpt, tmp_path):
    runs = []
    for name, (workload, options, by_relay) in SCENARIOS.items():
        for relay in by_relay:
            runs.append(
                {
                    "name": f"{name}, relay {'on' if relay else 'off'}",
                    "async": True,
                    "workload": workload,
                    "max_num_batched_tokens": 16 if name == "chunked prefill" else 64,
                    "options": {**options, "async_relay": relay},
                }
            )
    result = run_case(tmp_path, "runs", {"ckpt": ckpt, "workload": [], "runs": runs})
    for run in runs:
        name, relay = run["name"].split(", relay ")
        paths = SCENARIOS[name][2][relay == "on"]
        (stats,) = result.data[run["name"]]["stats"]
        async_steps = paths.count(S) + paths.count(R)
        assert stats["state_counts"] == {p: paths.count(p) for p in PATHS}, run["name"]
        assert (stats["async_steps"], stats["sync_fallback_steps"]) == (async_steps, len(paths) - async_steps)
        (out,) = result.data[run["name"]]["outputs"].values()
        assert len(out["tokens"]) == run["workload"][0]["params"]["max_tokens"]


# -- (e) tensor parallelism under vLLM's mp executor ----------------------------------------------


def test_tp2_under_vllms_mp_executor_gives_tp1_tokens_and_rank1_materializes_nothing(ckpt, tmp_path):
    workload = [item(str(i), prompt, 16, arrival=i) for i, prompt in enumerate(PROMPTS)]
    # Relay off: a step that breaks the async flow materializes on the step's thread, on the output rank only.
    options = {"async_relay": False}
    runs = [
        {"name": f"tp{tp}", "async": True, "backend": "mp", "tp": tp, "dtype": "float64", "options": options}
        for tp in (1, 2)
    ]
    result = run_case(tmp_path, "runs", {"ckpt": ckpt, "workload": workload, "runs": runs})
    tp1, tp2 = result.data["tp1"], result.data["tp2"]
    assert tokens_of(tp2) == tokens_of(tp1)
    assert all(len(tokens) == 16 for tokens in tokens_of(tp2).values())
    rank0, rank1 = tp2["stats"]
    assert (rank0["rank"], rank1["rank"]) == (0, 1)
    # Both ranks ran every step on the same path; only the output rank (vLLM's and ours: rank 0)
    # brought a step's tokens to the host. vLLM never reads rank 1's outputs, and our runner there
    # only feeds its futures forward.
    assert rank1["state_counts"] == rank0["state_counts"]
    assert rank1["outputs_created"] == rank0["outputs_created"] == rank0["outputs_materialized"] > 0
    assert rank1["outputs_materialized"] == 0
    assert rank0["state_counts"]["CompositionBreak"] > 0  # breaks that rank 0 materialized and rank 1 did not
    print(f"tp1 start {tp1['start_s']:.1f} s, tp2 start {tp2['start_s']:.1f} s", rank0, rank1)


def test_a_killed_non_output_rank_under_vllms_mp_executor_is_named_in_the_error(ckpt, tmp_path):
    """TP=2: rank 1's device process SIGKILLed mid-run. vLLM reads only rank 0's replies, where the
    failure shows as a collective whose peer went away; the engine core's error names rank 1."""
    run = {"name": "tp2", "async": True, "backend": "mp", "tp": 2, "options": {"device_timeout_s": 30}}
    result = run_case(tmp_path, "kill_rank", {"ckpt": ckpt, "run": run, "rank": 1}, timeout_s=240)
    pids, error = result.data["pids"], result.data["error"]
    print(f"error after {result.data['seconds']:.1f} s: {error}")
    assert error is not None, "the engine went on after rank 1's device died"
    named = f"tensor-parallel rank 1 failed: its device process {pids[1]} is gone"
    assert named in result.log, "\n".join(result.log.splitlines()[-40:])
    assert "tensor-parallel rank 0 failed" not in result.log
    assert result.data["seconds"] < 30, "the engine took the collective timeout to notice"
