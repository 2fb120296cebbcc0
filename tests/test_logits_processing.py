"""Penalties, logit_bias, min_tokens, min_p, allowed_token_ids and bad_words: tokens equal a float64
`transformers` reference with the same logits processors, in sync and async mode, and the token still
in flight is counted.

The reference runs transformers' own processors (MinNewTokensLengthLogitsProcessor,
SequenceBiasLogitsProcessor, RepetitionPenaltyLogitsProcessor, MinPLogitsWarper) in vLLM's order;
presence and frequency, which transformers lacks, are vLLM's formula written out here, and so are
allowed_token_ids and bad_words (transformers' NoBadWordsLogitsProcessor matches a word's start in
the prompt too; vLLM's only in the output).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from support.reference import VOCAB, hf_greedy, save_hf_model

from neuron_async_sm import LLM, SamplingParams
from neuron_async_sm.config import EngineConfig
from neuron_async_sm.engine.llm import PromptRequest
from neuron_async_sm.model.sampler import sample_tokens
from neuron_async_sm.outputs import ModelRunnerOutput, NewRequestData, SchedulerOutput
from neuron_async_sm.request import Request
from neuron_async_sm.sampling_params import InvalidRequestError, bad_words_token_ids
from neuron_async_sm.scheduler import Scheduler
from neuron_async_sm.worker.model_runner import ModelRunner

transformers = pytest.importorskip("transformers")

ENGINE = dict(
    dtype="float64",  # batch-invariant: a row's token does not depend on its neighbours
    max_num_seqs=8,
    max_model_len=64,
    max_num_batched_tokens=16,  # the long prompt below is chunked
    prefill_buckets=(8, 16),
    decode_buckets=(1, 2, 4, 8),
)
SEED = 7  # save_hf_model's seed: its greedy continuations of these prompts repeat tokens
REPEATS = [1, 40, 181, 59]  # plain greedy: 91 five times in a row
REPEATS_LONGER = [1, 54, 69, 94, 190, 123, 148, 46, 181]  # plain greedy: 49 nine times in a row
EOS_PROMPT = [1, 23, 182]  # plain greedy: 91, 130, ...; 130 is the checkpoint's EOS
EOS = 130
LONG = [1, *range(100, 140)]  # 41 tokens: three prefill chunks
NEW_TOKENS = 16


def cases() -> dict[str, PromptRequest]:
    def case(prompt: list[int], **params) -> PromptRequest:
        params.setdefault("ignore_eos", True)
        return PromptRequest(prompt, SamplingParams(max_tokens=NEW_TOKENS, **params))

    named = {
        "repetition": case(REPEATS, repetition_penalty=1.8),
        "repetition_below_one": case(REPEATS_LONGER, repetition_penalty=0.7),
        "frequency": case(REPEATS_LONGER, frequency_penalty=2.0),
        "frequency_negative": case(REPEATS, frequency_penalty=-0.5),
        "presence": case(REPEATS, presence_penalty=1.5),
        "logit_bias": case(REPEATS, logit_bias={5: 8.0, 91: -100.0, 17: 0.5}),
        "min_tokens": case(EOS_PROMPT, min_tokens=6, ignore_eos=False),
        "min_tokens_stop_ids": case(EOS_PROMPT, min_tokens=4, stop_token_ids=(113,), ignore_eos=False),
        "everything_chunked": case(
            LONG, repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.4, logit_bias={101: 3.0}
        ),
        "allowed": case(REPEATS, allowed_token_ids=(3, 17, 42, 77, 150, 181)),
        # (91, 91): no 91 right after a 91 (the greedy's run); (59, 91): the prompt ends with 59, and a
        # word's start in the prompt bans nothing (vLLM's); (17,): a one-token word, banned always.
        "bad_words": case(REPEATS, bad_words_token_ids=((91, 91), (59, 91), (17,))),
        "bad_words_three_tokens": case(REPEATS_LONGER, bad_words_token_ids=((49, 49, 49),)),
        "neutral": case(REPEATS),
    }
    return {name: PromptRequest(r.prompt_token_ids, r.sampling_params, name) for name, r in named.items()}


def reference(model, prompt: list[int], params: SamplingParams, eos: int) -> list[int]:
    """Greedy, float64, with transformers' processors in vLLM's order; stops at a stop token unless ignored."""
    lp = transformers
    processors = []
    stops = [*params.stop_token_ids, *(() if params.ignore_eos else (eos,))]
    if params.min_tokens:
        processors.append(lp.MinNewTokensLengthLogitsProcessor(len(prompt), params.min_tokens, stops))
    if params.logit_bias:
        processors.append(lp.SequenceBiasLogitsProcessor([[[t], b] for t, b in params.logit_bias]))
    if params.repetition_penalty != 1:
        processors.append(lp.RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    ids, out = torch.tensor([prompt]), []
    with torch.no_grad():
        while len(out) < params.max_tokens:
            logits = model(ids).logits[:, -1].double()  # [1, vocab]
            if params.allowed_token_ids is not None:  # vLLM's allowed_token_ids_mask
                allowed = torch.zeros(VOCAB, dtype=torch.bool)
                allowed[list(params.allowed_token_ids)] = True
                logits = logits.masked_fill(~allowed, float("-inf"))
            for word in params.bad_words_token_ids:  # vLLM's apply_bad_words: the word's start in the output
                start = list(word[:-1])
                if len(start) <= len(out) and out[len(out) - len(start) :] == start:
                    logits[0, word[-1]] = float("-inf")
            for processor in processors:
                logits = processor(ids, logits)
            # vLLM's (and OpenAI's) presence and frequency penalties, on the output tokens
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=VOCAB).double()
            logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).double()
            token = int(logits.argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            if token in stops:
                break
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, object]:
    path = tmp_path_factory.mktemp("hf")
    model = save_hf_model(path, seed=SEED).double()
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": EOS}))
    return path, model


@pytest.fixture(scope="module")
def expected(checkpoint) -> dict[str, list[int]]:
    _, model = checkpoint
    return {name: reference(model, r.prompt_token_ids, r.sampling_params, EOS) for name, r in cases().items()}


def test_the_prompts_lead_where_the_cases_need(checkpoint, expected):
    """Premises: unpenalized greedy repeats (so a penalty missing the last token would repeat it too),
    the EOS prompt reaches EOS early, and each case's reference differs from plain greedy."""
    _, model = checkpoint
    plain = {tuple(p): hf_greedy(model, p, NEW_TOKENS) for p in (REPEATS, REPEATS_LONGER, EOS_PROMPT)}
    assert plain[tuple(REPEATS)][:5] == [91] * 5 and plain[tuple(REPEATS_LONGER)][1:10] == [49] * 9
    assert plain[tuple(EOS_PROMPT)][1] == EOS
    for name, request in cases().items():
        if name not in ("neutral", "everything_chunked"):
            assert expected[name] != hf_greedy(model, request.prompt_token_ids, NEW_TOKENS)[: len(expected[name])], name
    assert EOS not in expected["min_tokens"][:6] and 113 not in expected["min_tokens_stop_ids"][:4]
    bad = expected["bad_words"]
    assert bad[0] == 91 and 91 in bad[2:] and 17 not in bad  # the prompt's 59 banned nothing; 91 came back
    assert all(bad[i : i + 2] != [91, 91] for i in range(len(bad)))
    three = expected["bad_words_three_tokens"]
    assert [49, 49] in [three[i : i + 2] for i in range(len(three))]  # a two-token run allowed, a third not
    assert set(expected["allowed"]) <= {3, 17, 42, 77, 150, 181}


@pytest.mark.parametrize(
    "mode",
    [dict(async_scheduling=False), dict(async_scheduling=True), dict(async_scheduling=False, on_device_sampling=False)],
    ids=["sync", "async", "host-sampling"],
)
def test_greedy_tokens_equal_transformers_with_the_same_processors(checkpoint, expected, mode):
    """Every case in one batch (rows with and without processing side by side). In async mode each
    decode step's input is the previous step's token, still on the device: a penalty that missed it
    (counted one step late) repeats the last token where the reference does not."""
    path, _ = checkpoint
    async_scheduling = mode["async_scheduling"]
    with LLM(str(path), device="cpu-inprocess", **mode, **ENGINE) as llm:
        outputs = llm.generate(list(cases().values()))
        stats = llm.stats()
    got = {out.request_id: out.output_token_ids for out in outputs}
    assert got == expected
    if async_scheduling:
        assert stats["async_steps"] >= stats["steps"] - 4, stats  # penalized requests stay async


def test_bad_words_without_penalties_in_the_step_still_read_their_outputs(checkpoint, expected):
    """No penalized row in the batch: the bad words alone make the steps write the token history
    they read (the word's start is the outputs just before, the last one still in flight)."""
    path, _ = checkpoint
    requests = [r for name, r in cases().items() if name.startswith("bad_words")]
    with LLM(str(path), device="cpu-inprocess", async_scheduling=True, **ENGINE) as llm:
        got = {out.request_id: out.output_token_ids for out in llm.generate(requests)}
    assert got == {r.request_id: expected[r.request_id] for r in requests}


def test_ngram_speculation_verifies_with_allowed_ids_and_bad_words(checkpoint, expected):
    """Verification processes each drafted position as a step would sample it: a bad word's start
    may be a draft just before it, and an accepted run gives the reference's tokens."""
    path, _ = checkpoint
    names = ("allowed", "bad_words", "bad_words_three_tokens")
    requests = [cases()[name] for name in names]
    speculative = {"method": "ngram", "num_speculative_tokens": 3}
    with LLM(str(path), device="cpu-inprocess", speculative_config=speculative, **ENGINE) as llm:
        got = {out.request_id: out.output_token_ids for out in llm.generate(requests)}
        spec = llm.stats()["spec_decode"]
    assert got == {name: expected[name] for name in names}
    assert spec["num_accepted_tokens"] > 0, spec


def test_min_p_keeps_the_tokens_transformers_keeps():
    """Seeded sampling with min_p draws only tokens MinPLogitsWarper keeps, and draws each of them."""
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2
    temperature = 0.7
    kept_hf = transformers.MinPLogitsWarper(0.2)(None, logits / temperature).isfinite()[0]
    draws = 4000
    tokens = sample_tokens(
        logits.expand(draws, -1),
        temperature=torch.full((draws,), temperature),
        top_k=torch.zeros(draws, dtype=torch.int32),
        top_p=torch.ones(draws),
        seeds=torch.arange(draws),
        output_index=torch.zeros(draws, dtype=torch.int64),
        min_p=torch.full((draws,), 0.2),
    )
    drawn = torch.zeros(64, dtype=torch.bool)
    drawn[tokens] = True
    assert 2 < int(kept_hf.sum()) < 20  # the filter really filters
    assert torch.equal(drawn, kept_hf)


# -- a preempted request resumed, and slot reuse (runner-level: our own scheduler never preempts) ----------

TINY = dict(
    dtype="float64",
    max_num_seqs=4,
    max_model_len=64,
    max_num_batched_tokens=32,
    prefill_buckets=(8, 16, 32),
    decode_buckets=(1, 2, 4),
)
# A greedy without penalties repeats token 998; with frequency and presence penalties its earlier
# outputs, recomputed as prompt after the restart, must still hold it back.
RESUMED = {
    "A": ([9, 9, 9, 10], SamplingParams(max_tokens=14, frequency_penalty=2.0, presence_penalty=0.5, ignore_eos=True)),
    "B": (
        [5, 6, 7, 8, 5, 6],
        SamplingParams(
            max_tokens=10, temperature=0.9, seed=6, repetition_penalty=1.3, frequency_penalty=1.0, ignore_eos=True
        ),
    ),
}
PREEMPT_AFTER = 5  # A's outputs before it is preempted


def _run_with_a_preemption(llm: LLM) -> dict[str, list[int]]:
    """A runs 5 steps in slot 0 and is preempted; B takes slot 0 (A's history still there); A
    restarts in slot 1 as vLLM restarts it: a new request whose prompt holds its 5 outputs
    (`num_output_tokens`), recomputed. Outputs are materialized as the engine core does (two steps
    in flight), all of them before the restart, whose prompt needs them."""
    runner = ModelRunner(llm.config, llm.engine.runtime, vocab_size=llm.vocab_size)
    outputs: dict[str, list[int]] = {"A": [], "B": []}
    pending: list = []
    computed: dict[str, int] = {}

    def collect(output) -> None:
        done = output if isinstance(output, ModelRunnerOutput) else output.get_output()
        for req, token in done.by_request().items():
            outputs[req].append(token)

    def step(step_id: int, new: list[NewRequestData], decode: list[str], finished=frozenset()) -> None:
        scheduled = {n.request_id: len(n.prompt_token_ids) for n in new} | dict.fromkeys(decode, 1)
        num_computed = {n.request_id: 0 for n in new} | {r: computed[r] for r in decode}
        for req, count in scheduled.items():
            computed[req] = num_computed[req] + count
        runner.execute_model(
            SchedulerOutput(
                step_id=step_id,
                num_scheduled_tokens=scheduled,
                num_computed_tokens=num_computed,
                scheduled_new_reqs=new,
                finished_req_ids=frozenset(finished),
                sampling_req_ids=frozenset(scheduled),
                all_decode=not new,
            )
        )
        pending.append(runner.sample_tokens())
        if len(pending) == 2:
            collect(pending.pop(0))

    def flush() -> None:
        while pending:
            collect(pending.pop(0))

    prompt_a, params_a = RESUMED["A"]
    prompt_b, params_b = RESUMED["B"]
    step(0, [NewRequestData("A", prompt_a, params_a, 5, 0)], [])
    for step_id in range(1, PREEMPT_AFTER):
        step(step_id, [], ["A"])
    flush()
    assert len(outputs["A"]) == PREEMPT_AFTER
    step(PREEMPT_AFTER, [NewRequestData("B", prompt_b, params_b, params_b.seed, 0)], [], finished={"A"})
    restart = NewRequestData("A", prompt_a + outputs["A"], params_a, 5, 1, PREEMPT_AFTER)
    step(PREEMPT_AFTER + 1, [restart], ["B"])
    sampled = {"A": PREEMPT_AFTER + 1, "B": 2}
    step_id = PREEMPT_AFTER + 2
    while rows := [r for r in ("B", "A") if sampled[r] < RESUMED[r][1].max_tokens]:
        step(step_id, [], rows)
        for r in rows:
            sampled[r] += 1
        step_id += 1
    flush()
    return outputs


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_preempted_request_resumed_counts_its_outputs_again(async_scheduling):
    """The restart recomputes A's outputs as prompt tokens of a new request; they are rewritten in the
    history of its new slot and still count as outputs (frequency, presence), so A samples what it
    samples uninterrupted. B, in A's old slot, reads none of A's history."""
    with LLM("tiny-llama", async_scheduling=False, device="cpu-inprocess", **TINY) as llm:
        alone = {r: llm.generate([prompt], params)[0].output_token_ids for r, (prompt, params) in RESUMED.items()}
    with LLM("tiny-llama", async_scheduling=async_scheduling, device="cpu-inprocess", **TINY) as llm:
        assert _run_with_a_preemption(llm) == alone


def test_the_compiled_devices_path_samples_what_the_host_path_samples():
    """A compiling device (XLA) runs the padded forward over the whole cache and every part of the
    processing for every processed step (no host shortcut). On the same steps, with a padding row
    and rows of each kind side by side, it samples what the eager host program samples."""
    from support.reference import RowStep, pack_step

    from neuron_async_sm.model import ModelSpec, build_step_program
    from neuron_async_sm.worker.processing_inputs import processing_inputs

    spec = ModelSpec("tiny-llama", "float64", max_num_seqs=4, max_model_len=48)
    host, compiled = build_step_program(spec), build_step_program(spec)
    compiled.packed, compiled.fixed_context = False, True  # what an XLA device runs
    params = [
        SamplingParams(max_tokens=20, frequency_penalty=2.0, presence_penalty=0.5, repetition_penalty=1.4),
        SamplingParams(
            max_tokens=20,
            logit_bias={998: 5.0, 15: -100.0},
            min_tokens=6,
            stop_token_ids=(54,),
            bad_words_token_ids=((998, 998), (7,)),
        ),
        SamplingParams(max_tokens=20, temperature=0.9, min_p=0.2, seed=3, allowed_token_ids=tuple(range(0, 1024, 3))),
    ]
    prompts = [[9, 9, 9, 10], [9, 9, 9, 10], [5, 6, 7, 8, 5]]
    processing = {k: torch.from_numpy(v) for k, v in processing_inputs(params, np.array([4, 4, 5]), 4, (2,)).items()}

    def run(program) -> list[list[int]]:
        sampling = [dict(temperature=p.temperature, seed=p.seed or 0) for p in params]
        rows = [RowStep(tuple(p), 0, slot, **sampling[slot]) for slot, p in enumerate(prompts)]
        out = [[t] for t in program(**pack_step(rows, program.scratch_slot, num_rows=4), **processing)[:3].tolist()]
        for _ in range(12):
            rows = [
                RowStep((o[-1],), len(p) + len(o) - 1, slot, output_index=len(o), **sampling[slot])
                for slot, (p, o) in enumerate(zip(prompts, out, strict=True))
            ]
            tokens = program(**pack_step(rows, program.scratch_slot, num_rows=4), **processing)
            for o, t in zip(out, tokens[:3].tolist(), strict=True):
                o.append(t)
        return out

    got = run(compiled)
    assert got == run(host)
    assert 54 not in got[1][:6] and len(set(got[0])) == len(got[0])  # min_tokens held; no repeat under penalties
    assert [998, 998] not in [got[1][i : i + 2] for i in range(len(got[1]))] and 998 in got[1]  # bad words
    assert all(t % 3 == 0 for t in got[2])  # allowed_token_ids


# -- bad_words' tokenization, and the refusals (no engine) ---------------------------------------------


def test_bad_words_are_tokenized_by_vllms_rule():
    """Each word bare (leading spaces dropped); with one leading space too when that starts with
    another token and has as many tokens: vLLM's SamplingParams.update_from_tokenizer."""
    vocab = {"cat": [5], " cat": [6], "big dog": [7, 8], " big dog": [9, 8], "ox": [3, 4], " ox": [2], "a": [1]}
    vocab[" a"] = [1]  # the same first token: not added again

    def encode(text: str) -> list[int]:
        return vocab[text]

    got = bad_words_token_ids(["cat", "  big dog", "ox", "a"], encode, vocab_size=10)
    assert got == ((5,), (6,), (7, 8), (9, 8), (3, 4), (1,))
    with pytest.raises(InvalidRequestError, match="bad_words: .* outside the vocabulary"):
        bad_words_token_ids(["cat"], encode, vocab_size=6)
    with pytest.raises(InvalidRequestError, match="bad_words: 'x' tokenizes to no token"):
        bad_words_token_ids(["x"], lambda text: [], vocab_size=6)
    with pytest.raises(InvalidRequestError, match="bad_words: more than 128"):
        bad_words_token_ids([f"w{i}" for i in range(65)], lambda text: [len(text)], vocab_size=10)


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"allowed_token_ids": [3, 100]}, "allowed_token_ids: token id 100 is outside the vocabulary"),
        ({"allowed_token_ids": []}, "allowed_token_ids: must not be empty"),
        ({"bad_words": ["w"]}, "bad_words: the model has no tokenizer.json"),
        ({"bad_words": [""]}, "bad_words: must be non-empty strings"),
        ({"bad_words_token_ids": [[3, 100]]}, "bad_words: token id 100 is outside the vocabulary"),
    ],
)
def test_bad_allowed_ids_and_bad_words_are_refused_naming_the_field(fields, says):
    scheduler = Scheduler(EngineConfig(max_model_len=32), eos_token_ids=(), vocab_size=100)
    with pytest.raises(InvalidRequestError, match=says):
        scheduler.add_request(Request("r", [1, 2], SamplingParams(**fields), 0, 0))
