"""`response_format` and vLLM's `structured_outputs` against a real `serve` process, through the official
`openai` client: completions and chat, streamed and not, every output satisfying its constraint and equal
to the offline LLM's for the same seed; a schema that does not compile is a 400 naming the field; under
draft_model speculation, the greedy constrained output of the offline LLM without it."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from support.grammar_model import CHOICES, MAX_TOKENS, PERSON, REGEX, write_json_model
from support.serve_harness import ServerProcess, serve_fixtures
from tokenizers import Tokenizer

from neuron_async_sm import LLM, SamplingParams
from neuron_async_sm.structured_output import StructuredOutputsParams

pytest.importorskip("llguidance")

FLAGS = ["--max-num-seqs", "4", "--max-model-len", "160", "--decode-buckets", "1,2,4", "--device", "cpu"]
SAMPLED = dict(temperature=1.0, seed=11)
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


model, server, _ = serve_fixtures(*FLAGS, write_model=write_json_model)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def offline_text(
    model: str, prompt_ids: list[int], structured: StructuredOutputsParams, sampled: dict = SAMPLED
) -> str:
    with LLM(model, device="cpu-inprocess", max_model_len=160, max_num_seqs=4, decode_buckets=(1, 2, 4)) as llm:
        params = SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=structured, **sampled)
        [out] = llm.generate([prompt_ids], params)
    return Tokenizer.from_file(f"{model}/tokenizer.json").decode(out.output_token_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_json_schema_validates_and_equals_the_offline_llm(client, model, stream):
    prompt = "a person:"
    kwargs = dict(model=model, prompt=prompt, max_tokens=MAX_TOKENS, extra_body={"response_format": SCHEMA_FORMAT})
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs, **SAMPLED))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        response = client.completions.create(**kwargs, **SAMPLED)
        text, finish = response.choices[0].text, [response.choices[0].finish_reason]
    jsonschema.validate(json.loads(text), PERSON)
    assert finish == ["stop"]
    ids = Tokenizer.from_file(f"{model}/tokenizer.json").encode(prompt).ids
    assert text == offline_text(model, ids, StructuredOutputsParams(json=PERSON))


@pytest.mark.parametrize("stream", [False, True])
def test_chat_response_format_json_schema_and_json_object(client, model, stream):
    messages = [{"role": "user", "content": "who?"}]
    for response_format, check in (
        (SCHEMA_FORMAT, lambda value: jsonschema.validate(value, PERSON)),
        ({"type": "json_object"}, lambda value: isinstance(value, dict) or pytest.fail(repr(value))),
    ):
        kwargs = dict(model=model, messages=messages, max_tokens=MAX_TOKENS, response_format=response_format)
        for seed in range(3):
            if stream:
                chunks = list(client.chat.completions.create(stream=True, **kwargs, temperature=1.0, seed=seed))
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            else:
                response = client.chat.completions.create(**kwargs, temperature=1.0, seed=seed)
                text, finish = response.choices[0].message.content, [response.choices[0].finish_reason]
            if response_format["type"] == "json_object" and finish == ["length"]:
                continue  # any object: a random walk through it may outlast max_tokens
            assert finish == ["stop"], text
            check(json.loads(text))


def test_vllms_structured_outputs_field(client, model):
    for structured, check in (
        ({"regex": REGEX}, lambda text: __import__("re").fullmatch(REGEX, text)),
        ({"choice": list(CHOICES)}, lambda text: text in CHOICES),
    ):
        response = client.completions.create(
            model=model, prompt="go", max_tokens=MAX_TOKENS, extra_body={"structured_outputs": structured}, **SAMPLED
        )
        assert check(response.choices[0].text), response.choices[0].text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": 5}}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
    ],
)
def test_a_constraint_that_does_not_compile_is_a_400_naming_the_field(client, model, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt="go", max_tokens=8, extra_body=extra)
    assert caught.value.body["param"] == param, caught.value.body


def test_a_response_format_under_draft_model_speculation_gives_the_greedy_constrained_output(model, tmp_path):
    """It used to be a 400 naming structured_outputs: the drafts the device proposes are cut on the host."""
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 3}  # the target as its own draft
    server = ServerProcess(tmp_path, model, *FLAGS, "--speculative-config", json.dumps(spec))
    try:
        client = server.client()
        prompt = "a person:"
        kwargs = dict(model=model, prompt=prompt, max_tokens=MAX_TOKENS, extra_body={"response_format": SCHEMA_FORMAT})
        response = client.completions.create(**kwargs, temperature=0.0)
        chunks = list(client.completions.create(stream=True, **kwargs, temperature=0.0))
    finally:
        assert server.terminate() == 0, server.log()
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert response.choices[0].finish_reason == "stop" and streamed == response.choices[0].text
    jsonschema.validate(json.loads(response.choices[0].text), PERSON)
    ids = Tokenizer.from_file(f"{model}/tokenizer.json").encode(prompt).ids
    greedy = offline_text(model, ids, StructuredOutputsParams(json=PERSON), {"temperature": 0.0})
    assert response.choices[0].text == greedy
