"""Logprobs through `neuron-async-sm serve` and the official `openai` client, against `transformers`.

lm-eval's `local-completions` loglikelihood request exactly as it sends it (lm_eval/models/
openai_completions.py, LocalCompletionsAPI._create_payload with generate=False: token-id prompts as a
batch, `echo`, `logprobs=1`, `max_tokens=1`, `temperature=0`, a seed) and its parser
(`parse_logprobs`: the sum of `token_logprobs[ctxlen:-1]` and the greedy check against
`top_logprobs`), non-streamed and streamed; chat's `logprobs` / `top_logprobs`. The server runs
float32 with async scheduling and a small token budget (the prompts' logprobs span chunks); the
reference is a float64 log_softmax of transformers' float32 logits on the same checkpoint (1e-4).
"""

from __future__ import annotations

import openai
import pytest
import torch
from support.reference import hf_logprobs
from support.serve_harness import ServerProcess, in_context, serve_fixtures

transformers = pytest.importorskip("transformers")

TOL = 1e-4
FLAGS = ["--max-num-seqs", "4", "--max-model-len", "64", "--max-num-batched-tokens", "8", "--prefill-buckets", "8"]
FLAGS += ["--decode-buckets", "1,2,4", "--device", "cpu", "--max-logprobs", "5"]


model, server, tokenizer = serve_fixtures(*FLAGS)


@pytest.fixture(scope="module")
def hf(model):
    return transformers.LlamaForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()


def lm_eval_body(server: ServerProcess, context: list[int], continuation: list[int]) -> dict:
    """What lm-eval's local-completions sends for one loglikelihood request (batch size 1)."""
    return dict(
        model=server.model,
        prompt=[context + continuation],
        temperature=0,
        max_tokens=1,
        logprobs=1,
        seed=1234,
        echo=True,
    )


def lm_eval_parse(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-eval's parse_logprobs for one choice."""
    token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    is_greedy = all(tok == max(top.values()) for tok, top in zip(token_logprobs, top_logprobs, strict=True))
    return sum(token_logprobs), is_greedy


CONTEXT = [1, 9, 14, 3, 22, 40, 7, 5, 33, 12]  # 10 tokens: with the continuation, two prefill chunks
CONTINUATIONS = ([30, 31, 32], [17])


@pytest.mark.parametrize("stream", [False, True], ids=["collected", "streamed"])
def test_lm_eval_loglikelihood_request_equals_transformers(server, hf, tokenizer, stream):
    client = server.client()
    for continuation in CONTINUATIONS:
        tokens = CONTEXT + continuation
        body = lm_eval_body(server, CONTEXT, continuation)
        if stream:
            chunks = [c.model_dump() for c in client.completions.create(**body, stream=True)]
            choices = [choice for c in chunks for choice in c["choices"]]
            # The first chunk echoes the prompt with its logprobs and brings the first token's.
            logprobs = {
                key: [v for choice in choices for v in choice["logprobs"][key]] for key in choices[0]["logprobs"]
            }
            choice = {"logprobs": logprobs, "text": "".join(c["text"] for c in choices)}
        else:
            out = client.completions.create(**body)
            [choice] = [c.model_dump() for c in out.choices]
        ref = hf_logprobs(hf, tokens + [0])  # the one generated token is greedy: row len(tokens) - 1
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(tokens) + 1  # the prompt, then the one output token
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        generated = int(ref[len(tokens) - 1].argmax())
        assert logprobs["tokens"] == [tokenizer.decode([t], skip_special_tokens=False) for t in tokens + [generated]]
        for i in range(1, len(tokens) + 1):
            token = tokens[i] if i < len(tokens) else generated
            assert abs(logprobs["token_logprobs"][i] - ref[i - 1, token].item()) <= TOL
            best = int(ref[i - 1].argmax())
            top = logprobs["top_logprobs"][i]  # the chosen token first, then the one most likely
            assert list(top) == list(dict.fromkeys([tokenizer.id_to_token(token), tokenizer.id_to_token(best)]))
            assert abs(top[tokenizer.id_to_token(best)] - ref[i - 1, best].item()) <= TOL
        offsets = logprobs["text_offset"]
        assert offsets == [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(len(offsets))]
        # vLLM's echo: the prompt decoded with its special tokens, then the output decoded after it
        assert choice["text"] == tokenizer.decode(tokens, skip_special_tokens=False) + in_context(
            tokenizer, tokens, [generated]
        )

        total, is_greedy = lm_eval_parse(choice, len(CONTEXT))
        rows = range(len(CONTEXT) - 1, len(tokens) - 1)
        expected = sum(ref[r, tokens[r + 1]].item() for r in rows)
        assert abs(total - expected) <= TOL * len(continuation)
        assert is_greedy == all(int(ref[r].argmax()) == tokens[r + 1] for r in rows)


def test_chat_logprobs_and_top_logprobs_equal_transformers_streamed_and_not(server, hf, tokenizer):
    client = server.client()
    messages = [{"role": "user", "content": "w5 w9 w17"}]
    _, rendered = server.post("/tokenize", {"messages": messages})
    prompt = rendered["tokens"]
    # Sampled (seeded): the chosen token is not always the most likely, so it and the top 3 differ.
    sampled = dict(temperature=1.5, seed=3, max_tokens=8, logprobs=True, top_logprobs=3)
    out = client.chat.completions.create(model=server.model, messages=messages, **sampled)
    content = out.choices[0].logprobs.content
    streamed = client.chat.completions.create(
        model=server.model,
        messages=messages,
        **sampled,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    chunks = [c for c in streamed if c.choices]
    ids = [t for c in chunks for t in (c.choices[0].token_ids or [])]
    assert len(ids) == len(content) == out.usage.completion_tokens
    assert [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content] == content
    ref = hf_logprobs(hf, prompt + ids)
    assert any(int(ref[len(prompt) - 1 + i].argmax()) != t for i, t in enumerate(ids)), "every token was the argmax"
    for i, (token, entry) in enumerate(zip(ids, content, strict=True)):
        row = ref[len(prompt) - 1 + i]
        assert abs(entry.logprob - row[token].item()) <= TOL
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3  # vLLM's: the first 3 of (chosen, top 1, top 2, top 3)
        expected = ([token] + [t for t in row.topk(3).indices.tolist() if t != token])[:3]
        assert [c.token for c in entry.top_logprobs] == [tokenizer.id_to_token(t) for t in expected]
        for candidate, t in zip(entry.top_logprobs, expected, strict=True):
            assert abs(candidate.logprob - row[t].item()) <= TOL


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "w5", "logprobs": 6}, "logprobs"),  # over --max-logprobs 5
        ("/v1/completions", {"prompt": "w5", "logprobs": -2}, "logprobs"),
        ("/v1/completions", {"prompt": "w5", "logprobs": 2, "echo": "yes"}, "echo"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 6}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs=true (vLLM's rule)
    ],
)
def test_bad_logprobs_get_a_400_naming_the_field(server, path, body, param):
    if "chat" in path:
        body = {"messages": [{"role": "user", "content": "w5"}], **body}
    status, answer = server.post(path, {"model": server.model, "max_tokens": 2, **body})
    assert status == 400 and answer["error"]["param"] == param, answer


def test_openai_client_refusal_is_a_bad_request_error(server):
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=server.model, prompt="w5", max_tokens=2, logprobs=6)
