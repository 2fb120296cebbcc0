"""`neuron-async-sm serve` through the official `openai` client, against a real uvicorn server process.

One server (async scheduling, float64 so tokens do not depend on the batch) answers completions and
chat, streamed and not, with exactly the tokens the offline `LLM` samples for the same seed; 32
concurrent streaming clients, some of which disconnect mid-stream, leave every request accounted for
and no KV slot held; bad requests get OpenAI-style 400s naming the field.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from support.processes import config_flags
from support.serve_harness import (
    CHAT_TEMPLATE,
    ServerProcess,
    in_context,
    offline_fixture,
    serve_fixtures,
    write_text_model,
)

from neuron_async_sm import LLM, SamplingParams

ENGINE = dict(
    dtype="float64",
    max_num_seqs=4,
    max_model_len=96,
    max_num_batched_tokens=32,
    prefill_buckets=(8, 16, 32),
    decode_buckets=(1, 2, 4),
)
FLAGS = config_flags(**ENGINE, device="cpu", device_time_ms=2)
SAMPLED = dict(temperature=0.8, top_p=0.95, seed=7)


model, server, tokenizer = serve_fixtures(
    *FLAGS, write_model=lambda path: write_text_model(path, chat_template="jinja")
)
offline = offline_fixture(**ENGINE)  # the reference (float64 is batch-invariant)


def reference(offline: LLM, prompt: list[int], **params) -> list[int]:
    [out] = offline.generate([prompt], SamplingParams(**params))
    return out.output_token_ids


def words(*ids: int) -> str:
    return " ".join(f"w{i}" for i in ids)


def test_completion_equals_the_offline_llm_streamed_and_not(server, offline, tokenizer):
    client = server.client()
    prompt = words(5, 9, 17, 30)
    prompt_ids = tokenizer.encode(prompt).ids
    for params in (dict(temperature=0.0), SAMPLED):
        expected = reference(offline, prompt_ids, max_tokens=12, ignore_eos=True, **params)
        extra = {"ignore_eos": True, "return_token_ids": True}
        out = client.completions.create(model=server.model, prompt=prompt, max_tokens=12, extra_body=extra, **params)
        [choice] = out.choices
        assert choice.token_ids == expected, params
        assert choice.text == in_context(tokenizer, prompt_ids, expected) and choice.finish_reason == "length"
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt_ids), 12)

        chunks = list(
            client.completions.create(
                model=server.model,
                prompt=prompt_ids,
                max_tokens=12,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True, "return_token_ids": True},
                **params,
            )
        )
        streamed = [t for c in chunks for choice in c.choices for t in choice.token_ids]
        assert streamed == expected
        assert "".join(choice.text for c in chunks for choice in c.choices) == in_context(
            tokenizer, prompt_ids, expected
        )
        assert [choice.finish_reason for c in chunks for choice in c.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_renders_the_template_and_equals_the_offline_llm(server, offline, tokenizer):
    from jinja2 import Template

    client = server.client()
    messages = [{"role": "system", "content": "w3 w4"}, {"role": "user", "content": "w10 w11 w12"}]
    rendered = Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True, bos_token="<s>")
    prompt_ids = tokenizer.encode(rendered, add_special_tokens=False).ids
    assert prompt_ids[0] == 1 and prompt_ids[-1] == tokenizer.token_to_id("assistant")
    expected = reference(offline, prompt_ids, max_tokens=10, ignore_eos=True, **SAMPLED)

    out = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=10, extra_body={"ignore_eos": True}, **SAMPLED
    )
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == in_context(tokenizer, prompt_ids, expected)
    assert out.usage.prompt_tokens == len(prompt_ids) and out.usage.completion_tokens == 10

    chunks = list(
        client.chat.completions.create(
            model=server.model,
            messages=messages,
            max_completion_tokens=10,
            stream=True,
            extra_body={"ignore_eos": True},
            **SAMPLED,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == in_context(tokenizer, prompt_ids, expected)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings_and_stop_token_ids_end_the_request(server, offline, tokenizer):
    client = server.client()
    prompt_ids = tokenizer.encode(words(7, 8, 9)).ids
    full = reference(offline, prompt_ids, max_tokens=12, ignore_eos=True, temperature=0.0)
    stop_word = tokenizer.decode([full[4]])
    cut = full.index(full[4])  # the stop string ends the text before its first occurrence
    for stream in (False, True):
        kwargs = dict(
            model=server.model,
            prompt=prompt_ids,
            max_tokens=12,
            temperature=0.0,
            stream=stream,
            extra_body={"ignore_eos": True},
        )
        out = client.completions.create(stop=[stop_word], **kwargs)
        chunks = list(out) if stream else [out]
        text = "".join(choice.text for c in chunks for choice in c.choices)
        assert text == in_context(tokenizer, prompt_ids, full[:cut]) + " "  # the space before the stop word
        assert chunks[-1].choices[0].finish_reason == "stop"
    out = client.completions.create(
        model=server.model,
        prompt=prompt_ids,
        max_tokens=12,
        temperature=0.0,
        extra_body={"ignore_eos": True, "stop_token_ids": [full[4]], "return_token_ids": True},
    )
    assert out.choices[0].token_ids == full[: cut + 1] and out.choices[0].finish_reason == "stop"


def test_models_health_and_metrics_routes(server):
    [card] = server.client().models.list().data
    assert card.id == server.model and card.max_model_len == 96
    assert server.get("/health")[0] == 200
    assert server.metric("neuron_async_sm_kv_slots_free") == 4


def _error(exc: openai.APIStatusError) -> dict:
    error = exc.body if "message" in (exc.body or {}) else (exc.body or {}).get("error", {})
    assert set(error) == {"message", "type", "param", "code"}, exc.body
    return error


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(prompt="w5", extra_body={"bogus": 1}), "bogus"),  # unknown field
        (dict(prompt="w5", max_tokens="ten"), "max_tokens"),  # bad type
        (dict(prompt=[5, True]), "prompt"),  # bad type inside the prompt
        (dict(prompt="w5", n=0), "n"),  # n sequences: at least one
        (dict(prompt="w5", temperature=-1.0), "temperature"),  # the engine's own check, field named
        (dict(prompt=" ".join(["w5"] * 96)), "prompt"),  # no room for output under max_model_len
        (dict(prompt="w5", max_tokens=200), "max_tokens"),  # prompt + max_tokens over max_model_len
        (dict(prompt=[5, 64]), "prompt"),  # a token id outside the vocabulary (the scheduler's check)
        (dict(prompt="w5", logprobs=21), "logprobs"),  # over --max-logprobs (20)
        (dict(prompt="w5", stream_options={"include_usage": True}), "stream_options"),  # without stream=true
        (dict(prompt="w5", extra_body={"top_k": -2}), "top_k"),  # -1 is off (vLLM's), below is an error
        (dict(prompt="w5", presence_penalty=2.5), "presence_penalty"),
        (dict(prompt="w5", frequency_penalty=-3.0), "frequency_penalty"),
        (dict(prompt="w5", logit_bias={"w5": 1.0}), "logit_bias"),  # keys are token ids
        (dict(prompt="w5", logit_bias={"64": 1.0}), "logit_bias"),  # outside the vocabulary
        (dict(prompt="w5", logit_bias={"5": 101.0}), "logit_bias"),
        (dict(prompt="w5", logit_bias={str(t): 1.0 for t in range(257)}), "logit_bias"),  # too many entries
        (dict(prompt="w5", extra_body={"repetition_penalty": 0.0}), "repetition_penalty"),
        (dict(prompt="w5", extra_body={"min_p": 1.5}), "min_p"),
        (dict(prompt="w5", max_tokens=4, extra_body={"min_tokens": 5}), "min_tokens"),
        (dict(prompt=[[5], [5, 64]]), "prompt"),  # one bad prompt of a batch refuses the batch
        (dict(prompt=[]), "prompt"),
    ],
)
def test_bad_requests_get_a_400_naming_the_field(server, kwargs, param):
    rejected = server.metric("neuron_async_sm_requests_rejected_total", reason="invalid")
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(model=server.model, **kwargs)
    error = _error(info.value)
    assert info.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    # Counted once, whichever layer refused it (the route's checks, validation, the engine).
    assert server.metric("neuron_async_sm_requests_rejected_total", reason="invalid") == rejected + 1


@pytest.mark.parametrize(
    "body, param",
    [
        # JSON can carry a lone surrogate (curl sends these bytes as they are); the openai client cannot.
        (b'{"model": "%s", "prompt": "w5 \\ud800"}', "prompt"),
        (b'{"model": "%s", "prompt": "w5", "stop": ["\\udfff"]}', "stop"),
        (b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800 w5"}]}', "messages"),
    ],
)
def test_a_lone_surrogate_gets_a_json_400_naming_the_field(server, body, param):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    status, answer = server.request("POST", path, body % server.model.encode())
    assert status == 400, answer
    error = json.loads(answer)["error"]
    assert error["param"] == param and "lone surrogate" in error["message"], error


def test_malformed_json_wrong_model_and_no_chat_template(server, tmp_path):
    status, body = server.request("POST", "/v1/completions", b'{"model": "x", "prompt": [1, 2')
    assert status == 400 and json.loads(body)["error"]["message"].startswith("malformed JSON"), body
    with pytest.raises(openai.NotFoundError) as info:
        server.client().completions.create(model="other", prompt="w5")
    assert _error(info.value)["code"] == "model_not_found"


def test_a_model_without_a_chat_template_gets_a_clear_400(tmp_path):
    model = write_text_model(tmp_path / "plain", chat_template=False)
    proc = ServerProcess(tmp_path, str(model), "--device", "cpu-inprocess", "--max-model-len", "64")
    try:
        with pytest.raises(openai.BadRequestError) as info:
            proc.client().chat.completions.create(model=str(model), messages=[{"role": "user", "content": "w5"}])
        error = _error(info.value)
        assert error["param"] == "messages" and "no chat template" in error["message"]
        assert proc.client().completions.create(model=str(model), prompt="w5", max_tokens=2).choices[0].text
    finally:
        assert proc.terminate() == 0, proc.log()


CONCURRENT = 32


def test_32_concurrent_streams_with_random_disconnects_leave_nothing_behind(server, offline, tokenizer):
    rng = random.Random(0)
    before = server.metrics()
    plans = [
        dict(
            prompt=[rng.randrange(3, 61) for _ in range(rng.randint(2, 20))],
            max_tokens=rng.randint(4, 24),
            seed=i,
            temperature=rng.choice([0.0, 0.8]),
            leave_after=rng.choice([None, None, 0, 1, 3, 8]),
        )
        for i in range(CONCURRENT)
    ]

    def run(plan: dict) -> tuple[list[int], str | None]:
        client = server.client()
        stream = client.completions.create(
            model=server.model,
            prompt=plan["prompt"],
            max_tokens=plan["max_tokens"],
            seed=plan["seed"],
            temperature=plan["temperature"],
            stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        tokens: list[int] = []
        reason = None
        for chunk in stream:
            if plan["leave_after"] is not None and len(tokens) >= plan["leave_after"]:
                stream.close()  # the client disconnects mid-stream
                return tokens, "left"
            for choice in chunk.choices:
                tokens.extend(choice.token_ids)
                reason = choice.finish_reason or reason
        return tokens, reason

    with ThreadPoolExecutor(CONCURRENT) as pool:
        results = list(pool.map(run, plans))

    for plan, (tokens, reason) in zip(plans, results, strict=True):
        expected = reference(
            offline,
            plan["prompt"],
            max_tokens=plan["max_tokens"],
            seed=plan["seed"],
            temperature=plan["temperature"],
            ignore_eos=True,
        )
        if reason == "left":
            assert tokens == expected[: len(tokens)]
        else:
            assert (tokens, reason) == (expected, "length"), plan

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return server.metric(name, **labels) - before.get(key, 0.0)

    def settled() -> bool:
        ended = sum(delta("vllm:request_success_total", finished_reason=r) for r in ("length", "abort"))
        return (
            ended == CONCURRENT
            and server.metric("vllm:num_requests_running") == 0
            and server.metric("vllm:num_requests_waiting") == 0
        )

    server.wait_for(settled, "every request finished or aborted")
    left = sum(reason == "left" for _, reason in results)
    assert left >= 8 and delta("vllm:request_success_total", finished_reason="abort") >= 1
    assert delta("vllm:request_success_total", finished_reason="error") == 0
    assert server.metric("neuron_async_sm_kv_slots_free") == ENGINE["max_num_seqs"], "a KV slot leaked"
    assert delta("vllm:prompt_tokens_total") == sum(len(p["prompt"]) for p in plans)
    assert delta("vllm:time_to_first_token_seconds_count") >= CONCURRENT - left
    assert server.metric("neuron_async_sm_steps_total", state="Steady") > 0
    assert server.metric("neuron_async_sm_materializations_total", thread="async-output") > 0
    # the server still answers
    started = time.monotonic()
    out = server.client().completions.create(model=server.model, prompt="w5 w6", max_tokens=3, temperature=0.0)
    assert out.choices[0].finish_reason in ("stop", "length") and time.monotonic() - started < 30
    print("\n" + server.get("/metrics")[1].decode())  # the scrape after the concurrency test (pytest -s)


# -- the clients people point at a vLLM server ------------------------------------------------------


def test_a_batch_of_prompts_gets_one_choice_per_prompt_in_order(server, offline, tokenizer):
    client = server.client()
    texts = ["w5 w9 w17", "w30", "w7 w8 w9 w10 w11"]
    ids = [tokenizer.encode(t).ids for t in texts]
    expected = [reference(offline, p, max_tokens=6, ignore_eos=True, **SAMPLED) for p in ids]
    extra = {"ignore_eos": True, "return_token_ids": True}
    for prompt in (texts, ids):
        out = client.completions.create(model=server.model, prompt=prompt, max_tokens=6, extra_body=extra, **SAMPLED)
        assert [c.index for c in out.choices] == [0, 1, 2]
        assert [c.token_ids for c in out.choices] == expected
        assert out.usage.prompt_tokens == sum(map(len, ids)) and out.usage.completion_tokens == 18
        chunks = list(
            client.completions.create(
                model=server.model, prompt=prompt, max_tokens=6, stream=True, extra_body=extra, **SAMPLED
            )
        )
        streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
        for chunk in chunks:
            for choice in chunk.choices:
                streamed[choice.index].extend(choice.token_ids)
        assert [streamed[i] for i in range(3)] == expected


def test_lm_eval_local_completions_bodies(server, offline, tokenizer):
    """The bodies lm-eval's `local-completions` sends with its defaults (tokenized_requests=True, batch 1):
    lm_eval/models/openai_completions.py, LocalCompletionsAPI._create_payload (generate=True), and
    lm_eval/utils.py, RemoteTokenizer / check_remote_tokenizer_support (/tokenizer_info, /tokenize)."""
    ids = tokenizer.encode(words(4, 8, 15, 16)).ids
    expected = reference(offline, ids, max_tokens=8, temperature=0.0)
    stop_word = tokenizer.decode([expected[3]])
    body = {"prompt": [ids], "model": server.model, "max_tokens": 8, "temperature": 0, "stop": [stop_word, "</s>"]}
    status, out = server.post("/v1/completions", {**body, "seed": 1234})
    assert status == 200, out
    [choice] = out["choices"]
    cut = expected.index(expected[3])
    assert choice["index"] == 0 and choice["finish_reason"] == "stop", out
    assert choice["text"] == in_context(tokenizer, ids, expected[:cut]) + " "  # the space before the stop word

    info = server.get_json("/tokenizer_info")
    assert info["eos_token"] == "</s>" and info["bos_token"] == "<s>" and "{{ bos_token }}" in info["chat_template"]
    _, answer = server.post("/tokenize", {"prompt": "test w5", "add_special_tokens": False})
    assert answer["tokens"] == tokenizer.encode("test w5", add_special_tokens=False).ids
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == ENGINE["max_model_len"]
    assert server.post("/detokenize", {"tokens": [1, 9, 10]}) == (200, {"prompt": "<s> w9 w10"})


def test_tokenize_a_chat_and_version(server, tokenizer):
    from jinja2 import Template

    messages = [{"role": "user", "content": "w10 w11"}]
    _, answer = server.post("/tokenize", {"model": server.model, "messages": messages, "return_token_strs": True})
    rendered = Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True, bos_token="<s>")
    assert answer["tokens"] == tokenizer.encode(rendered, add_special_tokens=False).ids
    assert answer["token_strs"] == [tokenizer.id_to_token(t) for t in answer["tokens"]]
    version = server.get_json("/version")["version"]
    assert version and version[0].isdigit(), version


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_guidellm_streaming_bodies_get_the_usage_in_every_chunk(server, offline, tokenizer, endpoint):
    """guidellm's streaming bodies: src/guidellm/backends/openai/request_handlers.py,
    TextCompletionsRequestHandler.format and ChatCompletionsRequestHandler.format (text column)."""
    body: dict = {
        "model": server.model,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "stop": None,
        "ignore_eos": True,
    }
    if endpoint == "completions":
        body.update(max_tokens=7, prompt="w5 w6 w7")
        prompt_ids = tokenizer.encode("w5 w6 w7").ids
    else:
        body.update(max_completion_tokens=7, messages=[{"role": "user", "content": [{"type": "text", "text": "w5"}]}])
        prompt_ids = tokenizer.encode("<s> user w5 assistant", add_special_tokens=False).ids
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    lines = server.sse(path, body)
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    with_tokens = [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason", 0) is not None]
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"] and c["usage"] is not None]
    assert counts == sorted(counts) and counts[-1] == 7, chunks  # the usage so far, in every chunk
    assert all(c["usage"]["prompt_tokens"] == len(prompt_ids) for c in chunks if c["choices"] and c["usage"])
    assert with_tokens, chunks
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 7,
        "total_tokens": len(prompt_ids) + 7,
    }


def test_top_k_minus_one_means_off(server, offline, tokenizer):
    prompt_ids = tokenizer.encode(words(3, 4, 5)).ids
    expected = reference(offline, prompt_ids, max_tokens=8, ignore_eos=True, **SAMPLED)
    out = server.client().completions.create(
        model=server.model,
        prompt=prompt_ids,
        max_tokens=8,
        extra_body={"ignore_eos": True, "return_token_ids": True, "top_k": -1},
        **SAMPLED,
    )
    assert out.choices[0].token_ids == expected


PROCESSING = [  # each as the openai client sends it: OpenAI's own fields, vLLM's through extra_body
    dict(frequency_penalty=2.0),
    dict(presence_penalty=2.0),
    dict(logit_bias={"5": 30.0, "42": -100.0}),
    dict(extra_body={"repetition_penalty": 1.6}),
    dict(extra_body={"min_p": 0.3}, **SAMPLED),
    dict(extra_body={"min_tokens": 4, "ignore_eos": False, "stop_token_ids": [36]}),
]


def _engine_params(params: dict) -> dict:
    flat = {**params, **params.get("extra_body", {})}
    flat.pop("extra_body", None)
    if "logit_bias" in flat:
        flat["logit_bias"] = {int(t): b for t, b in flat["logit_bias"].items()}
    return flat


@pytest.mark.parametrize(
    "params", PROCESSING, ids=["frequency", "presence", "logit_bias", "repetition", "min_p", "min_tokens"]
)
def test_penalties_logit_bias_min_tokens_and_min_p_are_honoured(server, offline, tokenizer, params):
    """Through the openai client, completions and chat: the tokens the offline LLM samples with the
    same parameters, which differ from what it samples without them."""
    client = server.client()
    prompt_ids = tokenizer.encode(words(7, 7, 9, 12, 7)).ids
    flat = {"ignore_eos": True, "temperature": 0.0, **_engine_params(params)}
    expected = reference(offline, prompt_ids, max_tokens=10, **flat)
    without = {k: v for k, v in flat.items() if k in ("ignore_eos", "temperature", "top_p", "seed", "stop_token_ids")}
    assert expected != reference(offline, prompt_ids, max_tokens=10, **without)  # the parameter matters here
    extra = {"ignore_eos": True, "return_token_ids": True, **params.get("extra_body", {})}
    sent = {k: v for k, v in params.items() if k != "extra_body"}
    sent.setdefault("temperature", 0.0)
    out = client.completions.create(model=server.model, prompt=prompt_ids, max_tokens=10, extra_body=extra, **sent)
    assert out.choices[0].token_ids == expected

    messages = [{"role": "user", "content": words(7, 7, 9)}]
    chat = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=10, extra_body=extra, **sent
    )
    _, body = server.post("/tokenize", {"model": server.model, "messages": messages, "add_generation_prompt": True})
    assert chat.choices[0].token_ids == reference(offline, body["tokens"], max_tokens=10, **flat)


def test_metrics_carry_vllms_names_and_the_model_name(server):
    out = server.client().completions.create(model=server.model, prompt="w5 w6", max_tokens=3, temperature=0.0)
    assert out.choices
    from prometheus_client.parser import text_string_to_metric_families

    _, body = server.get("/metrics")
    families = list(text_string_to_metric_families(body.decode()))
    named = {s.name for f in families for s in f.samples if s.labels.get("model_name") == server.model}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
        "vllm:request_prefill_time_seconds_bucket",
        "vllm:request_decode_time_seconds_bucket",
        "vllm:request_inference_time_seconds_bucket",
        "vllm:request_prompt_tokens_bucket",
        "vllm:request_generation_tokens_bucket",
    ):
        assert name in named, name
    assert "process_resident_memory_bytes" in {s.name for f in families for s in f.samples}
    for name in ("queue_time", "prefill_time", "decode_time", "inference_time"):
        assert server.metric(f"vllm:request_{name}_seconds_count") >= 1, name
    assert server.metric("vllm:request_generation_tokens_sum") >= 3
