"""`n` over HTTP (vLLM's parallel sampling): n choices per prompt, `index` = prompt index * n + child,
child i seeded `seed + i`, on completions and chat, streamed and not, each choice exactly the tokens
the offline `LLM` gives the same child; a stop string that ends one child leaves the others running;
a client that leaves frees every child; `best_of` is honoured at n and refused otherwise.
"""

from __future__ import annotations

import json
from dataclasses import replace

import openai
import pytest
from support.serve_harness import ServerProcess, in_context, offline_fixture, serve_fixtures
from test_serve import ENGINE, FLAGS

from neuron_async_sm import LLM, SamplingParams

MAX_NUM_SEQS = ENGINE["max_num_seqs"]
MAX_WAITING = 4
SAMPLED = dict(temperature=0.9, top_p=0.95, seed=21)
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True, **SAMPLED)


model, server, tokenizer = serve_fixtures(*FLAGS, "--device-time-ms", "10", "--max-waiting", str(MAX_WAITING))
offline = offline_fixture(**ENGINE)


def children(offline: LLM, prompt: list[int], n: int, params: SamplingParams = PARAMS) -> list[list[int]]:
    """The offline LLM's n sequences of `prompt`, in child order."""
    outputs = offline.generate([prompt], replace(params, n=n))
    assert [o.index for o in outputs] == list(range(n))
    return [o.output_token_ids for o in outputs]


def body(server: ServerProcess, **fields) -> dict:
    return {"model": server.model, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True, **SAMPLED, **fields}


def streamed(server: ServerProcess, path: str, request: dict) -> tuple[dict[int, list[int]], dict[int, str], dict]:
    """(token ids by index, finish_reason by index, the final usage) of a streamed answer."""
    lines = server.sse(path, {**request, "stream": True, "stream_options": {"include_usage": True}})
    assert lines[-1] == "[DONE]"
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in map(json.loads, lines[:-1]):
        for choice in chunk["choices"]:
            tokens.setdefault(choice["index"], []).extend(choice["token_ids"] or [])
            if choice["finish_reason"] is not None:
                reasons[choice["index"]] = choice["finish_reason"]
        usage = chunk["usage"] or usage
    return tokens, reasons, usage


def test_completions_n_choices_equal_the_offline_children_streamed_and_not(server, offline, tokenizer):
    prompt = "w5 w9 w17"
    ids = tokenizer.encode(prompt).ids
    expected = children(offline, ids, 3)
    assert len({tuple(e) for e in expected}) == 3, "the children must be different samples"

    status, out = server.post("/v1/completions", body(server, prompt=prompt, n=3))
    assert status == 200, out
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in out["choices"]] == expected
    assert [c["text"] for c in out["choices"]] == [in_context(tokenizer, ids, e) for e in expected]
    # A prompt's tokens count once, as vLLM counts them; every child's output counts.
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 24, "total_tokens": len(ids) + 24}

    tokens, reasons, usage = streamed(server, "/v1/completions", body(server, prompt=prompt, n=3))
    assert [tokens[i] for i in range(3)] == expected and reasons == {0: "length", 1: "length", 2: "length"}
    assert usage == out["usage"]


def test_a_batch_with_n_is_prompt_major(server, offline):
    prompts = [[5, 6, 7], [40, 41]]
    status, out = server.post("/v1/completions", body(server, prompt=prompts, n=2))
    assert status == 200, out
    expected = [tokens for prompt in prompts for tokens in children(offline, prompt, 2)]
    assert [(c["index"], c["token_ids"]) for c in out["choices"]] == list(enumerate(expected))


def test_chat_n_choices_equal_the_offline_children_streamed_and_not(server, offline, tokenizer):
    messages = [{"role": "user", "content": "w10 w11"}]
    ids = tokenizer.encode("<s> user w10 w11 assistant", add_special_tokens=False).ids
    expected = children(offline, ids, 2)

    status, out = server.post("/v1/chat/completions", body(server, messages=messages, n=2))
    assert status == 200, out
    assert [(c["index"], c["token_ids"]) for c in out["choices"]] == list(enumerate(expected))
    assert [c["message"]["content"] for c in out["choices"]] == [in_context(tokenizer, ids, e) for e in expected]

    tokens, reasons, _ = streamed(server, "/v1/chat/completions", body(server, messages=messages, n=2))
    assert [tokens[i] for i in range(2)] == expected and reasons == {0: "length", 1: "length"}


def test_a_stop_string_ends_one_child_and_the_others_run_on(server, offline, tokenizer):
    ids = [5, 9, 17]
    expected = children(offline, ids, 3)
    # A word child 0 produces and some other child never does: it ends child 0 only.
    stop_id = next(t for t in expected[0] if any(t not in e for e in expected[1:]))
    stop_word = tokenizer.id_to_token(stop_id)
    cut = [e.index(stop_id) if stop_id in e else None for e in expected]

    status, out = server.post("/v1/completions", body(server, prompt=ids, n=3, stop=[stop_word]))
    assert status == 200, out
    for choice, tokens, at in zip(out["choices"], expected, cut, strict=True):
        if at is None:
            assert (choice["token_ids"], choice["finish_reason"]) == (tokens, "length")
        else:
            text = in_context(tokenizer, ids, tokens[:at]) + " "  # the space before the stop word
            assert choice["finish_reason"] == "stop" and choice["text"] == text, (choice, tokens)


def test_best_of_is_honoured_at_n_and_refused_otherwise(server, offline):
    status, out = server.post("/v1/completions", body(server, prompt=[5, 6], n=2, best_of=2))
    assert status == 200 and [c["token_ids"] for c in out["choices"]] == children(offline, [5, 6], 2), out
    for best_of, why in ((3, "best_of > n is not supported"), (1, "must be >= n")):
        status, out = server.post("/v1/completions", body(server, prompt=[5, 6], n=2, best_of=best_of))
        assert status == 400 and out["error"]["param"] == "best_of" and why in out["error"]["message"], out


def test_n_is_refused_by_name_when_invalid_or_more_than_the_server_holds(server):
    for n in (0, -1):
        status, out = server.post("/v1/completions", body(server, prompt=[5, 6], n=n))
        assert status == 400 and out["error"]["param"] == "n", out
    status, out = server.post("/v1/completions", body(server, prompt=[[5, 6], [7]], n=MAX_NUM_SEQS + 1))
    assert status == 400 and out["error"]["param"] == "n" and "--max-waiting" in out["error"]["message"], out


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "collected"])
def test_a_client_that_leaves_frees_every_child(server, stream):
    n, max_tokens = 3, 80  # 80 steps of 10 ms or more: the client leaves long before the end
    before = server.metrics()

    def delta(name: str, **labels: str) -> float:
        return server.metric(name, **labels) - before.get((name, tuple(sorted(labels.items()))), 0.0)

    request = dict(model=server.model, prompt=[5, 6, 7], n=n, max_tokens=max_tokens, extra_body={"ignore_eos": True})
    if stream:
        chunks = server.client().completions.create(stream=True, **request, **SAMPLED)
        next(iter(chunks))
        chunks.close()  # the client disconnects mid-stream
    else:
        with pytest.raises(openai.APITimeoutError):
            server.client(timeout_s=0.5).completions.create(**request, **SAMPLED)

    def settled() -> bool:
        return delta("vllm:request_success_total", finished_reason="abort") == n

    server.wait_for(settled, "every child aborted")
    # None ran to its end (ignore_eos: the only other ending is the abort). How many tokens each made
    # before the server saw the client leave depends on the machine's load: no bound on that.
    assert delta("vllm:request_success_total", finished_reason="length") == 0
    server.wait_for(lambda: server.metric("vllm:num_requests_running") == 0, "the slots to be given back")
    assert server.metric("neuron_async_sm_kv_slots_free") == MAX_NUM_SEQS
