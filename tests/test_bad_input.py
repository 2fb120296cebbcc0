"""A bad request is rejected on its own, with a message naming the field; nothing else is lost.

Three layers: `SamplingParams` / `parse_request_line` (no engine), the `LLM` API
(`add_request` raises, `generate` returns an error output), and `neuron-async-sm generate`
(one `"error"` output line per bad line, every other request completes).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.processes import generate_argv

from neuron_async_sm import LLM, InvalidRequestError, PromptRequest, SamplingParams
from neuron_async_sm.cli import main
from neuron_async_sm.generate import parse_request_line
from neuron_async_sm.model import load_model_config

VOCAB = load_model_config("tiny-llama").vocab_size
MAX_MODEL_LEN = 64
ENGINE = dict(device="cpu-inprocess", max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=32, prefill_buckets=(16, 32))
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=11)


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-llama", **ENGINE) as engine:
        yield engine


# -- SamplingParams and one JSONL line, no engine ----------------------------------------------------

BAD_PARAMS = [
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=-3)),
    ("max_tokens", dict(max_tokens=2.5)),
    ("max_tokens", dict(max_tokens=True)),
    ("temperature", dict(temperature=-0.1)),
    ("temperature", dict(temperature=float("nan"))),
    ("temperature", dict(temperature="hot")),
    ("top_p", dict(top_p=0)),
    ("top_p", dict(top_p=1.5)),
    ("top_p", dict(top_p=float("nan"))),
    ("top_k", dict(top_k=-2)),  # -1 is off (vLLM's)
    ("top_k", dict(top_k=2.5)),
    ("presence_penalty", dict(presence_penalty=2.5)),
    ("presence_penalty", dict(presence_penalty="high")),
    ("frequency_penalty", dict(frequency_penalty=-2.01)),
    ("repetition_penalty", dict(repetition_penalty=0)),
    ("repetition_penalty", dict(repetition_penalty=float("inf"))),
    ("min_p", dict(min_p=-0.1)),
    ("min_p", dict(min_p=1.5)),
    ("min_tokens", dict(min_tokens=-1)),
    ("min_tokens", dict(min_tokens=17)),  # above max_tokens (16)
    ("logit_bias", dict(logit_bias=[1, 2])),
    ("logit_bias", dict(logit_bias={-1: 1.0})),
    ("logit_bias", dict(logit_bias={"5": 1.0})),
    ("logit_bias", dict(logit_bias={5: 100.5})),
    ("logit_bias", dict(logit_bias={t: 1.0 for t in range(257)})),  # more than MAX_LOGIT_BIAS
    ("seed", dict(seed=-1)),
    ("seed", dict(seed=2**63)),
    ("stop_token_ids", dict(stop_token_ids=5)),
    ("stop_token_ids", dict(stop_token_ids="12")),
    ("stop_token_ids", dict(stop_token_ids=[3, -1])),
    ("ignore_eos", dict(ignore_eos="yes")),
]


@pytest.mark.parametrize(("field", "kwargs"), BAD_PARAMS, ids=[f"{f}={v}" for f, k in BAD_PARAMS for v in k.values()])
def test_bad_sampling_params_name_the_field(field, kwargs):
    with pytest.raises(InvalidRequestError, match=f"^{field}: "):
        SamplingParams(**kwargs)


def test_good_sampling_params_are_accepted():
    params = SamplingParams(max_tokens=1, temperature=0, top_p=1, top_k=0, seed=0, stop_token_ids=[4, 5])
    assert params.stop_token_ids == (4, 5)
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's "off"
    biased = SamplingParams(logit_bias={9: 100, 3: -100.0}, min_tokens=16, repetition_penalty=0.5, min_p=1)
    assert biased.logit_bias == ((3, -100.0), (9, 100.0)) and hash(biased)


BAD_LINES = [
    # (JSONL line, the field the error must name)
    ('{"prompt_token_ids": [1, 2], "max_tokens": 0}', "max_tokens"),
    ('{"prompt_token_ids": [1, 2], "max_tokens": -1}', "max_tokens"),
    ('{"prompt_token_ids": [1, 2]}', "max_tokens"),  # missing
    ('{"prompt_token_ids": [1, 2], "max_tokens": 4, "temperature": -1}', "temperature"),
    ('{"prompt_token_ids": [1, 2], "max_tokens": 4, "top_p": 0}', "top_p"),
    ('{"prompt_token_ids": [1, 2], "max_tokens": 4, "top_p": 1.5}', "top_p"),
    ('{"prompt_token_ids": [1, 2], "max_tokens": 4, "stop_token_ids": 7}', "stop_token_ids"),
    ('{"prompt_token_ids": [1, 2], "max_tokens": 4, "temprature": 0.5}', "temprature"),  # unknown field
    ('{"prompt_token_ids": "1 2 3", "max_tokens": 4}', "prompt_token_ids"),
    ('{"prompt_token_ids": 12, "max_tokens": 4}', "prompt_token_ids"),
    ('{"max_tokens": 4}', "prompt_token_ids"),  # no prompt at all
    ('{"prompt": "hello", "max_tokens": 4}', "prompt"),  # text without a tokenizer
    ('{"prompt_token_ids": [1, 2], "max_tokens": 4, "arrival_step": -1}', "arrival_step"),
    ('{"prompt_token_ids": [1, 2], "max_tokens": 4, "arrival_step": 1.5}', "arrival_step"),
    ('{"prompt_token_ids": [1, 2], "max_tokens": 4, "request_id": 7}', "request_id"),
    ('{"prompt_token_ids": [1, 2], "max_tokens": 4, "logit_bias": {"x": 1}}', "logit_bias"),
    ('{"prompt_token_ids": [1, 2], "max_tokens": 4, "min_tokens": 5}', "min_tokens"),
    ('{"prompt_token_ids": [1, 2], "max_tokens": 4, "allowed_token_ids": []}', "allowed_token_ids"),
    ('{"prompt_token_ids": [1, 2], "max_tokens": 4, "bad_words": "no"}', "bad_words"),
]


def test_a_line_with_logits_processing_fields_parses():
    line = (
        '{"prompt_token_ids": [1, 2], "max_tokens": 4, "presence_penalty": 0.5, "frequency_penalty": -1,'
        ' "repetition_penalty": 1.2, "min_p": 0.1, "min_tokens": 2, "logit_bias": {"7": -100, "3": 2.5},'
        ' "allowed_token_ids": [3, 7, 9], "bad_words": ["no", "never"]}'
    )
    params = parse_request_line(line, 0, tokenizer=None).sampling_params
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -1, 1.2)
    assert (params.min_p, params.min_tokens, params.logit_bias) == (0.1, 2, ((3, 2.5), (7, -100.0)))
    assert (params.allowed_token_ids, params.bad_words) == ((3, 7, 9), ("no", "never"))


@pytest.mark.parametrize(("line", "field"), BAD_LINES, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_LINES)])
def test_bad_request_line_names_the_field(line, field):
    with pytest.raises(InvalidRequestError, match=f"^{field}: "):
        parse_request_line(line, 0, tokenizer=None)


@pytest.mark.parametrize("line", ["{not json", "[1, 2, 3]", '"text"'])
def test_a_line_that_is_not_a_json_object_names_its_line_number(line):
    with pytest.raises(InvalidRequestError, match="^line 7: "):
        parse_request_line(line, 6, tokenizer=None)


def test_text_prompt_is_encoded_by_the_tokenizer():
    class Tokenizer:  # ServedTokenizer's encode: text to ids
        def encode(self, text: str) -> list[int]:
            assert text == "hello"
            return [8, 9, 10]

    request = parse_request_line('{"prompt": "hello", "max_tokens": 2, "request_id": "t"}', 0, Tokenizer())
    assert request.prompt_token_ids == [8, 9, 10] and request.request_id == "t"
    with pytest.raises(InvalidRequestError, match="^prompt: "):
        parse_request_line('{"prompt": 5, "max_tokens": 2}', 0, Tokenizer())


# -- the LLM API -------------------------------------------------------------------------------------

BAD_PROMPTS = [
    ([], "empty prompt"),
    ([5, VOCAB], f"token id {VOCAB} is outside the vocabulary"),
    ([5, -1], "token id -1 is outside the vocabulary"),
    ([5, True], "token id True"),
    ([5, "6"], "token id '6'"),
    ([7] * MAX_MODEL_LEN, f"leaves no room for output under max_model_len={MAX_MODEL_LEN}"),
]


def run_to_completion(llm: LLM, deltas: list | None = None) -> dict[str, list[int]]:
    """Step until idle; the tokens each request emitted (including those in `deltas`, already stepped)."""
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str | None] = {}
    pending = list(deltas or [])
    for _ in range(1000):
        if not pending and not llm.has_unfinished_requests():
            break
        for delta in pending or llm.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            if delta.finish_reason is not None:
                finish[delta.request_id] = delta.finish_reason
        pending = []
    assert not llm.has_unfinished_requests()
    assert set(finish.values()) <= {"length", "stop"}, finish
    return tokens


def test_add_request_rejects_bad_input_and_keeps_serving_the_others(llm):
    expected = {
        out.request_id: out.output_token_ids
        for out in llm.generate([PromptRequest([5, 6, 7], GREEDY, "g"), PromptRequest([8, 9], SEEDED, "s")])
    }
    llm.add_request([5, 6, 7], GREEDY, "g")
    first = llm.step()  # "g" is in flight while the bad ones arrive
    for i, (prompt, message) in enumerate(BAD_PROMPTS):
        with pytest.raises(InvalidRequestError, match="^prompt_token_ids: ") as info:
            llm.add_request(prompt, GREEDY, f"bad-{i}")
        assert message in str(info.value)
    with pytest.raises(InvalidRequestError, match="^request_id: duplicate"):
        llm.add_request([1, 2], GREEDY, "g")
    llm.add_request([8, 9], SEEDED, "s")
    llm.add_request([5, 6, 7], GREEDY, "bad-0")  # a rejected id left nothing behind: it is free
    tokens = run_to_completion(llm, first)
    assert tokens["g"] == expected["g"] and tokens["s"] == expected["s"] and tokens["bad-0"] == expected["g"]
    assert not any(k.startswith("bad-") and k != "bad-0" for k in tokens)


def test_generate_returns_an_error_for_each_bad_request_and_completes_the_rest(llm):
    good = [PromptRequest([5, 6, 7], GREEDY, "g"), PromptRequest([8, 9], SEEDED, "s")]
    alone = {out.request_id: out.output_token_ids for out in llm.generate(good)}
    bad = [PromptRequest(prompt, GREEDY, f"bad-{i}") for i, (prompt, _) in enumerate(BAD_PROMPTS)]
    mixed = [bad[0], good[0], *bad[1:3], good[1], *bad[3:]]
    outputs = llm.generate(mixed)
    assert [o.request_id for o in outputs] == [r.request_id for r in mixed]
    by_id = {o.request_id: o for o in outputs}
    for i, (_, message) in enumerate(BAD_PROMPTS):
        out = by_id[f"bad-{i}"]
        assert out.finished and out.finish_reason == "error" and out.output_token_ids == []
        assert out.error.startswith("prompt_token_ids: ") and message in out.error
    for req_id, tokens in alone.items():
        assert by_id[req_id].finish_reason in ("length", "stop") and by_id[req_id].error is None
        assert by_id[req_id].output_token_ids == tokens
    assert not llm.has_unfinished_requests()


def test_a_rejected_request_does_not_shift_the_seeds_of_unseeded_requests():
    unseeded = PromptRequest([5, 6, 7], SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True), "u")
    with LLM("tiny-llama", **ENGINE) as a:
        alone = a.generate([unseeded])[0].output_token_ids
    with LLM("tiny-llama", **ENGINE) as b:
        after_bad = b.generate([PromptRequest([], GREEDY, "bad"), unseeded])[1].output_token_ids
    assert after_bad == alone


def test_generate_rejects_a_duplicate_request_id_without_merging_outputs(llm):
    first = PromptRequest([5, 6, 7], GREEDY, "dup")
    outputs = llm.generate([first, PromptRequest([8, 9], GREEDY, "dup")])
    assert outputs[0].finish_reason == "length" and len(outputs[0].output_token_ids) == GREEDY.max_tokens
    assert outputs[1].finish_reason == "error" and outputs[1].error.startswith("request_id: ")


def test_generate_returns_an_error_for_a_prompt_that_is_not_a_list(llm):
    outputs = llm.generate([PromptRequest(None, GREEDY, "none"), PromptRequest([5, 6, 7], GREEDY, "g")])  # type: ignore[arg-type]
    assert outputs[0].finish_reason == "error" and outputs[0].error.startswith("prompt_token_ids: ")
    assert outputs[1].finish_reason == "length"


# -- the CLI -----------------------------------------------------------------------------------------

GOOD_ROWS = [
    {"request_id": "g1", "prompt_token_ids": [5, 6, 7], "max_tokens": 6, "ignore_eos": True},
    {"request_id": "g2", "prompt_token_ids": [3] * 40, "max_tokens": 5, "temperature": 0.8, "seed": 3},
    {"request_id": "g3", "prompt_token_ids": [9, 10], "max_tokens": 4, "top_p": 1, "arrival_step": 3},
    {"request_id": "g4", "prompt_token_ids": [VOCAB - 1] * (MAX_MODEL_LEN - 1), "max_tokens": 4},  # fits: 1 out
]
BAD_ROWS = [
    # (line, the field its error names)
    ({"request_id": "b-empty", "prompt_token_ids": [], "max_tokens": 4}, "prompt_token_ids"),
    ({"request_id": "b-vocab", "prompt_token_ids": [5, VOCAB], "max_tokens": 4}, "prompt_token_ids"),
    ({"request_id": "b-long", "prompt_token_ids": [5] * MAX_MODEL_LEN, "max_tokens": 4}, "prompt_token_ids"),
    ({"prompt_token_ids": [5, 6], "max_tokens": 0}, "max_tokens"),
    ({"prompt_token_ids": [5, 6], "max_tokens": 4, "temperature": -0.5}, "temperature"),
    ({"prompt_token_ids": [5, 6], "max_tokens": 4, "top_p": 0}, "top_p"),
    ({"prompt_token_ids": [5, 6], "max_tokens": 4, "top_p": 1.5}, "top_p"),
    ({"request_id": "g1", "prompt_token_ids": [5, 6], "max_tokens": 4}, "request_id"),  # in flight with g1
    ({"request_id": "g3", "prompt_token_ids": [5, 6], "max_tokens": 4, "arrival_step": 40}, "request_id"),
    ('{"prompt_token_ids": [5, 6], "max_tokens": ', "line"),  # malformed JSONL
    ({"prompt_token_ids": [5, 6]}, "max_tokens"),
    ({"prompt_token_ids": [5, 6], "max_tokens": 4, "colour": "red"}, "colour"),
    ({"prompt_token_ids": "5 6", "max_tokens": 4}, "prompt_token_ids"),
    ({"prompt": "hello", "max_tokens": 4}, "prompt"),
    ({"prompt_token_ids": [5, 6], "max_tokens": 4, "stop_token_ids": 2}, "stop_token_ids"),
]


def run_generate(tmp_path: Path, lines: list[str], name: str) -> list[dict]:
    prompts, out = tmp_path / f"{name}.in.jsonl", tmp_path / f"{name}.jsonl"
    prompts.write_text("\n".join(lines) + "\n", encoding="utf-8")
    argv = [
        "generate",
        "--prompts",
        prompts,
        "--output",
        out,
        "--no-progress",
        "--device",
        "cpu-inprocess",
        "--max-model-len",
        MAX_MODEL_LEN,
        "--max-num-batched-tokens",
        32,
        "--prefill-buckets",
        "16,32",
    ]
    code = main([str(a) for a in argv])
    results = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert code == (1 if any(r["finish_reason"] == "error" for r in results) else 0), "exit 1 iff a request failed"
    return results


def test_cli_answers_each_bad_line_with_an_error_and_completes_every_other_request(tmp_path):
    as_line = lambda row: row if isinstance(row, str) else json.dumps(row)  # noqa: E731
    alone = run_generate(tmp_path, [as_line(r) for r in GOOD_ROWS], "alone")
    # Interleave: a bad line before, between and after the good ones, and a blank line in the middle.
    lines, expected = [], []
    bad = iter(BAD_ROWS)
    for good in GOOD_ROWS:
        for row, field in [next(bad), next(bad)]:
            lines.append(as_line(row))
            expected.append((len(lines), field))
        lines.append(as_line(good))
        expected.append((len(lines), None))
    lines.append("")
    for row, field in bad:
        lines.append(as_line(row))
        expected.append((len(lines), field))

    results = run_generate(tmp_path, lines, "mixed")
    assert len(results) == len(expected) == len(GOOD_ROWS) + len(BAD_ROWS)
    good_results = []
    for result, (line_no, field) in zip(results, expected, strict=True):
        assert set(result) == {"request_id", "output_token_ids", "finish_reason", "error"}
        if field is None:
            good_results.append(result)
            continue
        assert result["finish_reason"] == "error" and result["output_token_ids"] == [], result
        prefix = f"line {line_no}: " if field == "line" else f"{field}: "
        assert result["error"].startswith(prefix), (line_no, result)
    assert [r["request_id"] for r in good_results] == [r["request_id"] for r in GOOD_ROWS]
    assert all(r["finish_reason"] in ("length", "stop") and r["error"] is None for r in good_results)
    assert good_results == alone  # nothing lost, nothing changed by the bad lines around them


def test_cli_error_output_keeps_the_request_id_of_the_rejected_line(tmp_path):
    lines = [
        json.dumps({"request_id": "mine", "prompt_token_ids": [5, 6], "max_tokens": 0}),  # bad, own id
        json.dumps({"request_id": "ok", "prompt_token_ids": [5, 6], "max_tokens": 2}),
        json.dumps({"request_id": "ok", "prompt_token_ids": [7], "max_tokens": 2}),  # duplicate of line 2
        json.dumps({"request_id": 7, "prompt_token_ids": [7], "max_tokens": 2}),  # id not a string
        "not json",
    ]
    results = run_generate(tmp_path, lines, "ids")
    assert [r["request_id"] for r in results] == ["mine", "ok", "line-3", "line-4", "line-5"]
    assert [r["finish_reason"] for r in results] == ["error", "length", "error", "error", "error"]


def test_cli_unwritable_output_is_one_line_naming_the_file(tmp_path, capsys):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the output's directory should be")
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [1, 2], "max_tokens": 2}) + "\n")
    assert main(generate_argv(prompts, blocker / "out.jsonl", process=False)) == 2  # before the device starts
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write {blocker}: ") and "[Errno" not in err, err


def test_cli_unwritable_stats_file_fails_before_the_run(tmp_path, capsys):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the stats file's directory should be")
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [1, 2], "max_tokens": 2}) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(generate_argv(prompts, out, "--stats", blocker / "stats.json", process=False)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --stats: cannot write {blocker / 'stats.json'}: ") and "[Errno" not in err, err
    assert not out.exists() and not out.with_name("out.jsonl.partial").exists(), "nothing may have run"
