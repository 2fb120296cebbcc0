"""A client that leaves a non-streaming request gets its request aborted in the engine at once.

A non-streaming completion or chat request sends nothing until the request has finished, so a client
that gives up waiting (a timeout, a closed tab) leaves while the engine still generates. The server
watches the connection and aborts the request when the client is gone; otherwise it would run to
`max_tokens` unseen, holding its KV slot. A real `serve` process (programs of 25 ms, so a long
request runs for seconds), the official `openai` client with a short timeout: after it leaves,
/metrics shows the request aborted after a few of its tokens, its slot free.
"""

from __future__ import annotations

import time

import openai
import pytest
from support.serve_harness import serve_fixtures

MAX_NUM_SEQS = 4
MAX_TOKENS = 100  # ~2.5 s of programs: the client leaves long before that
CLIENT_TIMEOUT_S = 0.5
FLAGS = ["--device-time-ms", "25", "--max-model-len", "128", "--max-num-seqs", str(MAX_NUM_SEQS)]
PARAMS = dict(max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True})


model, server, _ = serve_fixtures(*FLAGS)


def completion(client: openai.OpenAI, model: str) -> None:
    client.completions.create(model=model, prompt=[5, 9, 17, 30], **PARAMS)


def chat(client: openai.OpenAI, model: str) -> None:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "w5 w9 w17"}], **PARAMS)


@pytest.mark.parametrize("call", [completion, chat], ids=["completions", "chat"])
def test_a_client_that_leaves_a_non_streaming_request_gets_it_aborted_at_once(server, call):
    ended = ("vllm:request_success_total", "finished_reason")
    before = server.metrics()

    def delta(name: str, **labels: str) -> float:
        return server.metric(name, **labels) - before.get((name, tuple(sorted(labels.items()))), 0.0)

    def finished(reason: str) -> float:
        return delta(ended[0], **{ended[1]: reason})

    client = server.client(timeout_s=CLIENT_TIMEOUT_S)
    with pytest.raises(openai.APITimeoutError):
        call(client, server.model)  # the client gives up and closes its connection
    left = time.monotonic()

    def settled() -> bool:
        return sum(finished(r) for r in ("stop", "length", "abort", "error")) >= 1

    server.wait_for(settled, "the request to finish", timeout_s=30)
    waited = time.monotonic() - left
    assert delta("vllm:prompt_tokens_total") > 0, "the request never reached the engine"
    generated = delta("vllm:generation_tokens_total")
    print(f"{call.__name__}: ended {waited:.2f} s after the client left, {generated:.0f} tokens generated")
    assert finished("abort") == 1 and finished("length") == 0, server.metrics()
    assert generated < MAX_TOKENS / 2, f"{generated} tokens generated for a client that had left"
    server.wait_for(lambda: server.metric("vllm:num_requests_running") == 0, "the slot to be given back")
    assert server.metric("neuron_async_sm_kv_slots_free") == MAX_NUM_SEQS
