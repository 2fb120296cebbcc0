"""Warm-up covers every program shape serving enqueues, the relay's included (issue 12: no compile while serving).

A compiling device (XLA, Neuron) builds one program per input signature. Here the CPU plays one, through
the engine's runtime seam (`runtime_factory`): the accelerator backend on the CPU built with ops that say
they compile per shape (so the worker pads the relay input as it does on XLA), over the engine's own
programs wrapped to log each call's signature: a signature first seen after warm-up is a program XLA
would have compiled while serving. Runs in the main environment, in seconds.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pytest
import torch
from support.workloads import WorkItem, drive, random_workload

from neuron_async_sm import LLM, EngineConfig, PromptRequest, SamplingParams
from neuron_async_sm.runtime import Program, ProgramFactory, WarmupCall
from neuron_async_sm.runtime.accelerator_runtime import AcceleratorOps
from neuron_async_sm.runtime.local_runtime import LocalRuntime
from neuron_async_sm.sampling_params import InvalidRequestError
from neuron_async_sm.worker.model_runner import RELAY_PAD_PROGRAM

SHAPES = dict(
    dtype="float64",
    max_num_seqs=4,
    max_model_len=128,
    max_num_batched_tokens=16,  # long prompts are chunked: mixed steps beside decodes
    prefill_buckets=(8, 16),
    decode_buckets=(1, 2, 4, 8),
)

Signature = tuple[str, tuple[tuple[str, tuple[int, ...], torch.dtype, int | None], ...]]


class CompilingAcceleratorOps(AcceleratorOps):
    """The accelerator backend (on this machine, the CPU) as a device that compiles one program per shape."""

    compiles = True


@dataclass(frozen=True)
class SignatureLoggingPrograms:
    """``inner``'s programs, each call logging (program, input names, shapes, dtypes) to ``calls``."""

    inner: ProgramFactory
    calls: list[Signature]

    def __call__(self, device: torch.device) -> Mapping[str, Program]:
        def logged(name: str, program: Program) -> Program:
            def call(**inputs: torch.Tensor) -> torch.Tensor:
                self.calls.append((name, tuple(sorted(_signature(k, v) for k, v in inputs.items()))))
                return program(**inputs)

            return call

        return {name: logged(name, program) for name, program in self.inner(device).items()}


def _signature(name: str, value: torch.Tensor) -> tuple:
    """An input as it selects the compiled program: its shape and dtype, and a count's value (the top
    logprobs, read on the host, shape what the program computes)."""
    count = int(value[0]) if name in ("sample_logprobs", "prompt_logprobs") else None
    return name, tuple(value.shape), value.dtype, count


@dataclass
class SignatureLog:
    """A ``RuntimeFactory`` (the engine's runtime seam): the compiling accelerator, its calls in ``calls``."""

    calls: list[Signature] = field(default_factory=list)

    def __call__(
        self, config: EngineConfig, programs: ProgramFactory, warmup: Sequence[WarmupCall] = ()
    ) -> LocalRuntime:
        assert config.device == "accelerator", config
        return LocalRuntime(
            CompilingAcceleratorOps(None), SignatureLoggingPrograms(programs, self.calls), config, warmup
        )


def test_serving_with_the_relay_enqueues_no_signature_warm_up_did_not():
    log = SignatureLog()
    rng = random.Random(4321)
    workloads = [random_workload(rng, f"w{n}", max_prompt=40) for n in range(4)]
    plain = dict(SHAPES, sampling_extras=False)  # no extras asked: their warm-up would only cost time
    with LLM("tiny-llama", device="accelerator", async_scheduling=True, runtime_factory=log, **plain) as llm:
        warmed = set(log.calls)
        started = len(log.calls)  # calls from here on are serving's
        for items in workloads:
            drive(llm, items, aborts=True)
        stats = llm.stats()
    served = set(log.calls[started:])
    assert warmed, "warm-up ran no program"
    assert stats["state_counts"]["Relay"] > 0, stats  # the relay is on (the default) and churn relays
    assert any(name == RELAY_PAD_PROGRAM for name, _ in served), "serving did not pad the relay input"
    assert served - warmed == set(), "serving enqueued a signature warm-up did not compile"
    assert stats["compilations"] == 0  # the key is there on a compiling device


def test_speculation_enqueues_no_signature_warm_up_did_not():
    """Every spec step (prompt chunks, rows verifying drafts, rows fed from next_input: SpecSteady,
    SpecExit, ReorderRemap; with sampling extras and without) is a spec program call warm-up ran, on
    every row count and bucket."""
    log = SignatureLog()
    rng = random.Random(29)
    items = [with_extras(rng, i) if rng.random() < 0.5 else i for i in random_workload(rng, "w", max_prompt=40)]
    spec = {"method": "draft_model", "model": "tiny-llama", "num_speculative_tokens": 2}  # the target drafts
    config = dict(SHAPES, speculative_config=spec)
    with LLM("tiny-llama", device="accelerator", async_scheduling=True, runtime_factory=log, **config) as llm:
        warmed = set(log.calls)
        started = len(log.calls)
        drive(llm, items, aborts=True)
        stats = llm.stats()
    served = set(log.calls[started:])
    assert stats["state_counts"]["SpecSteady"] > 0, stats
    fed = [s for s in served if any(k == "drafted_input" for k, *_ in s[1])]
    assert any(any(k == "sample_logprobs" for k, *_ in s[1]) for s in fed), "no fed step with extras"
    assert any(all(k != "sample_logprobs" for k, *_ in s[1]) for s in fed), "no fed step without extras"
    assert served - warmed == set(), "serving enqueued a signature warm-up did not compile"


def with_extras(rng: random.Random, item: WorkItem) -> WorkItem:
    """`item` with penalties, min_p and logprobs (0..5 top tokens), or some of them, or none. No
    logit_bias or min_tokens: their lists' width is part of the shape, warmed only one wide."""
    extras = dict(
        presence_penalty=rng.choice([0.0, 1.5]),
        frequency_penalty=rng.choice([0.0, 0.3]),
        repetition_penalty=rng.choice([1.0, 1.5]),
        min_p=rng.choice([0.0, 0.1]),
        logprobs=rng.choice([None, 0, 2, 5]),
    )
    return dataclasses.replace(item, params=dataclasses.replace(item.params, **extras))


def test_penalties_and_logprobs_enqueue_no_signature_warm_up_did_not():
    log = SignatureLog()
    rng = random.Random(77)
    workloads = [[with_extras(rng, i) for i in random_workload(rng, f"w{n}", max_prompt=40)] for n in range(2)]
    with LLM("tiny-llama", device="accelerator", async_scheduling=True, runtime_factory=log, **SHAPES) as llm:
        warmed = set(log.calls)
        started = len(log.calls)
        for items in workloads:
            drive(llm, items, aborts=True)
    served = set(log.calls[started:])
    extras = {s for s in served if any(k == "sample_logprobs" for k, *_ in s[1])}
    assert extras and served - extras, "the workload ran no step with extras, or no step without"
    assert served - warmed == set(), "serving enqueued a signature warm-up did not compile"


def test_without_sampling_extras_warm_up_is_the_plain_programs_and_such_requests_are_refused():
    log = SignatureLog()
    config = dict(SHAPES, sampling_extras=False)
    with LLM("tiny-llama", device="accelerator", runtime_factory=log, **config) as llm:
        assert not any(k == "sample_logprobs" for _, s in log.calls for k, *_ in s)
        with pytest.raises(InvalidRequestError, match="presence_penalty: .*--no-sampling-extras"):
            llm.add_request([5, 6, 7], SamplingParams(max_tokens=2, presence_penalty=0.5))
        with pytest.raises(InvalidRequestError, match="logprobs: "):
            llm.add_request([5, 6, 7], SamplingParams(max_tokens=2, logprobs=1))
        assert [len(o.output_token_ids) for o in llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))] == [2]


@pytest.fixture(scope="module")
def json_model(tmp_path_factory) -> str:
    pytest.importorskip("llguidance")
    from support.grammar_model import write_json_model

    return str(write_json_model(tmp_path_factory.mktemp("json-model")))


def constrained_requests(seed: int, count: int, max_prompt: int = 12) -> list[PromptRequest]:
    """Constrained requests (sampled, seeded) among free ones, arriving at different steps; a prompt
    of up to 1 + max_prompt tokens (longer than the token budget: chunked, its first chunk unmasked)."""
    from support.grammar_model import CONSTRAINTS

    rng = random.Random(seed)
    return [
        PromptRequest(
            [1, *rng.choices(range(3, 300), k=rng.randint(1, max_prompt))],
            SamplingParams(
                max_tokens=16,
                temperature=1.0,
                seed=i,
                structured_outputs=CONSTRAINTS[i % len(CONSTRAINTS)].params if i % 3 else None,
            ),
            f"r{i}",
            arrival_step=rng.randint(0, 12),
        )
        for i in range(count)
    ]


GRAMMAR_SHAPES = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, prefill_buckets=(16,))


@pytest.mark.parametrize("sampling_extras", [True, False], ids=["extras", "no-extras"])
def test_grammars_enqueue_no_signature_warm_up_did_not(json_model, sampling_extras):
    """With a tokenizer the engine takes structured output: warm-up adds the masked variant and the
    deferred step's forward and sampling, so constrained requests among free ones (fused and
    deferred sampling, Steady and Relay) enqueue nothing new; with --no-sampling-extras too, where a
    grammar's step carries no extras."""
    log = SignatureLog()
    requests = constrained_requests(5, 9)
    config = dict(GRAMMAR_SHAPES, decode_buckets=(1, 2, 4), sampling_extras=sampling_extras)
    with LLM(json_model, device="accelerator", runtime_factory=log, **config) as llm:
        warmed = set(log.calls)
        started = len(log.calls)
        outputs = llm.generate(requests)
        stats = llm.stats()
    served = set(log.calls[started:])
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    assert stats["deferred_steps"] > 0 and stats["state_counts"]["Relay"] > 0, stats
    masked = {s for s in served if any(k == "token_bitmask" for k, *_ in s[1])}
    assert masked and served - masked, "the workload ran no masked step, or no unmasked one"
    assert served - warmed == set(), "serving enqueued a signature warm-up did not compile"


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("sampling_extras", [True, False], ids=["extras", "no-extras"])
def test_grammars_under_speculation_enqueue_no_signature_warm_up_did_not(json_model, sampling_extras, method):
    """Under speculation a constrained row's spec step carries its mask, one row per verified position
    (`[rows, 1 + k, words]`): warm-up runs that variant of every spec call (fed too under draft_model,
    async), so constrained requests among free ones enqueue nothing new."""
    log = SignatureLog()
    spec = {"method": method, "num_speculative_tokens": 2}
    if method == "draft_model":
        spec["model"] = json_model  # the target as its own draft: every draft the target's argmax
    config = dict(GRAMMAR_SHAPES, speculative_config=spec, sampling_extras=sampling_extras)
    with LLM(json_model, device="accelerator", runtime_factory=log, **config) as llm:
        warmed = set(log.calls)
        started = len(log.calls)
        outputs = llm.generate(constrained_requests(7, 8, max_prompt=24))
        stats = llm.stats()
    served = set(log.calls[started:])
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    assert stats["spec_decode"]["num_spec_rows"] > 0, stats["spec_decode"]  # rows verified drafts
    masked = {s for s in served if any(k == "token_bitmask" for k, *_ in s[1])}
    assert masked and served - masked, "the workload ran no masked step, or no unmasked one"
    assert served - warmed == set(), "serving enqueued a signature warm-up did not compile"
