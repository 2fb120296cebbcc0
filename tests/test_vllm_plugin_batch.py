"""vllm_plugin/batch.py without vLLM: vLLM's sampling parameters as ours, kept across a restart, and
a step's grammar rows. vLLM's objects are stood in for by namespaces with the fields batch.py reads
(vLLM 0.33's names); the end-to-end checks under vLLM are tests/under_vllm/test_vllm_parity.py."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from neuron_async_sm.vllm_plugin.batch import BatchTranslator, sampling_params

VOCAB = 64


def vllm_params(**fields) -> SimpleNamespace:
    """vLLM 0.33's SamplingParams defaults, with `fields` changed."""
    defaults = dict(
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        seed=None,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        min_tokens=0,
        logit_bias=None,
        allowed_token_ids=None,
        bad_words_token_ids=None,  # vLLM's tokenization of bad_words (None: none)
        logprobs=None,
        prompt_logprobs=None,
        structured_outputs=None,
        all_stop_token_ids=set(),
        max_tokens=16,
    )
    return SimpleNamespace(**{**defaults, **fields})


def new_req(req_id: str, prompt: list[int], params: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(
        req_id=req_id, prompt_token_ids=prompt, prefill_token_ids=None, num_computed_tokens=0, sampling_params=params
    )


def step(
    scheduled: dict[str, int], new=(), cached=(), resumed=(), all_tokens=None, preempted=(), spec=None
) -> SimpleNamespace:
    """vLLM's SchedulerOutput; `cached`: (req_id, num_computed) of running (or resumed) requests;
    `spec`: its scheduled_spec_decode_tokens."""
    return SimpleNamespace(
        scheduled_spec_decode_tokens=spec or {},
        finished_req_ids=set(),
        preempted_req_ids=set(preempted),
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _ in cached],
            num_computed_tokens=[n for _, n in cached],
            resumed_req_ids=set(resumed),
            all_token_ids=all_tokens or {},
        ),
        num_scheduled_tokens=scheduled,
    )


def test_every_supported_vllm_sampling_parameter_reaches_ours():
    params = vllm_params(
        temperature=0.7,
        top_k=-1,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.2,
        min_tokens=3,
        logit_bias={9: 2.5, 4: -100.0},
        logprobs=-1,
        prompt_logprobs=2,
        all_stop_token_ids={2, 7},
        allowed_token_ids=[5, 6, 9],
        bad_words_token_ids=[[3], [8, 4]],
    )
    ours = sampling_params(params, 16, VOCAB)
    assert (ours.temperature, ours.top_k, ours.min_p) == (0.7, 0, 0.1)
    assert (ours.presence_penalty, ours.frequency_penalty, ours.repetition_penalty) == (0.5, -0.25, 1.2)
    assert ours.logit_bias == ((4, -100.0), (9, 2.5))
    # min_tokens holds back vLLM's whole stop set (its stop ids and EOS); we add no EOS of our own
    assert (ours.min_tokens, ours.stop_token_ids, ours.ignore_eos) == (3, (2, 7), True)
    assert (ours.logprobs, ours.prompt_logprobs) == (VOCAB, 2)  # -1: the whole vocabulary
    assert (ours.allowed_token_ids, ours.bad_words_token_ids) == ((5, 6, 9), ((3,), (8, 4)))


def test_a_restarted_request_keeps_its_parameters_but_not_its_prompt_logprobs():
    params = vllm_params(
        temperature=0.9, seed=5, presence_penalty=0.4, min_tokens=6, logit_bias={3: 1.0}, prompt_logprobs=1
    )
    translator = BatchTranslator(max_num_seqs=2, max_model_len=64, vocab_size=VOCAB)
    first = translator.translate(step({"a": 4}, new=[new_req("a", [1, 5, 6, 7], params)]))
    (started,) = first.scheduled_new_reqs
    translator.translate(step({"a": 1}, cached=[("a", 4)]))
    # preempted after 3 outputs, resumed by model runner V1 with every token it had
    tokens = [1, 5, 6, 7, 20, 21, 22]
    again = translator.translate(
        step({"a": 7}, cached=[("a", 0)], resumed={"a"}, all_tokens={"a": tokens}, preempted={"a"})
    )
    (restart,) = again.scheduled_new_reqs
    assert restart.prompt_token_ids == tokens and restart.num_output_tokens == 3
    assert restart.seed == started.seed == 5
    # every parameter as it was (the output indices continue), the prompt's logprobs already sent
    assert restart.sampling_params == replace(started.sampling_params, prompt_logprobs=None)
    assert started.sampling_params.prompt_logprobs == 1 and translator.restarts == 1


def test_a_steps_grammar_rows_are_its_sampling_rows_of_requests_with_a_grammar():
    translator = BatchTranslator(max_num_seqs=2, max_model_len=64, vocab_size=VOCAB)
    grammar = vllm_params(structured_outputs=object())
    first = translator.translate(
        step({"g": 4, "p": 3}, new=[new_req("g", [1, 2, 3, 4, 5, 6], grammar), new_req("p", [1, 2, 3], vllm_params())])
    )
    assert first.structured_output_req_ids == frozenset()  # g's first chunk samples nothing
    second = translator.translate(step({"g": 2, "p": 1}, cached=[("g", 4), ("p", 3)]))
    assert second.structured_output_req_ids == frozenset({"g"}) and second.sampling_req_ids == {"g", "p"}


def test_vllms_scheduled_drafts_are_the_rows_drafts_and_real_ids_are_verified_as_sent():
    translator = BatchTranslator(max_num_seqs=3, max_model_len=64, vocab_size=VOCAB, speculative=True)
    prompts = {"a": [1, 5, 6], "b": [1, 7, 8], "c": [1, 9]}
    translator.translate(
        step({r: len(p) for r, p in prompts.items()}, new=[new_req(r, p, vllm_params()) for r, p in prompts.items()])
    )
    # synchronous: the drafts our worker proposed, cut by vLLM (b's to one); c had none
    sync = translator.translate(
        step({"a": 4, "b": 2, "c": 1}, cached=[("a", 3), ("b", 3), ("c", 2)], spec={"a": [4, 5, 6], "b": [9], "c": []})
    )
    assert sync.num_draft_tokens == {"a": 3, "b": 1}
    assert sync.draft_token_ids == {"a": (4, 5, 6), "b": (9,)}
    assert not sync.all_decode and sync.sampling_req_ids == {"a", "b", "c"}
    # async: placeholders, counted (vLLM's optimistic computed tokens) but never verified as ids
    fed = translator.translate(step({"a": 4, "b": 4}, cached=[("a", 7), ("b", 5)], spec={"a": [-1] * 3, "b": [-1] * 3}))
    assert fed.num_draft_tokens == {"a": 3, "b": 3} and fed.draft_token_ids == {}
    assert fed.num_computed_tokens == {"a": 7, "b": 5}
