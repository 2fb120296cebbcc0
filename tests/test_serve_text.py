"""`serve` writes text as `vllm serve` does, on a SentencePiece-style tokenizer (Llama's: "▁"-prefixed
words, a decoder that strips the text's first space): an output is decoded after its prompt, so its
first word keeps its space (" the", where decoding the output alone gives "the"), streamed and not,
completions and chat, echoed after the prompt; a stop string may begin with that space; logprobs'
token texts keep it too. The reference is the tokenizer decoding prompt and output at once, minus the
prompt's text (tests/under_vllm/test_vllm_detokenizer.py pins our decoder to vLLM's own).
"""

from __future__ import annotations

import json

import pytest
from support.sentencepiece_model import write_sentencepiece_model
from support.serve_harness import ServerProcess, in_context, serve_fixtures

FLAGS = ["--device", "cpu-inprocess", "--max-model-len", "96", "--max-num-seqs", "4", "--decode-buckets", "1,2,4"]
model, server, tokenizer = serve_fixtures(*FLAGS, write_model=write_sentencepiece_model)
PROMPT = "the cat"
MESSAGES = [{"role": "user", "content": "the dog ran"}]


@pytest.fixture(scope="module")
def words(tokenizer) -> list[int]:
    """The vocabulary's "▁word" tokens: outputs made of them start with a space after any prompt."""
    return sorted(i for token, i in tokenizer.get_vocab().items() if token[:1] == "\u2581" and token[1:].isalpha())


def body(server: ServerProcess, words: list[int], **fields: object) -> dict:
    common = dict(model=server.model, max_tokens=6, temperature=1.0, seed=5, return_token_ids=True)
    return {**common, "allowed_token_ids": words, **fields}


def streamed(server: ServerProcess, path: str, request: dict) -> tuple[str, list[int], list[dict]]:
    """(text, token ids, chunks' choices) of a streamed answer."""
    choices = [c for line in server.sse(path, {**request, "stream": True})[:-1] for c in json.loads(line)["choices"]]
    text = "".join(c["text"] if "text" in c else c["delta"].get("content") or "" for c in choices)
    return text, [t for c in choices for t in c["token_ids"] or []], choices


def test_a_completion_reads_as_prompt_and_output_decoded_together(server, tokenizer, words):
    prompt_ids = tokenizer.encode(PROMPT).ids
    status, out = server.post("/v1/completions", body(server, words, prompt=PROMPT))
    assert status == 200, out
    [choice] = out["choices"]
    want = in_context(tokenizer, prompt_ids, choice["token_ids"])
    assert tokenizer.decode(choice["token_ids"]) == want[1:]  # decoded alone, the first space is lost
    assert choice["text"] == want and want.startswith(" ")
    text, ids, _ = streamed(server, "/v1/completions", body(server, words, prompt=PROMPT))
    assert (text, ids) == (want, choice["token_ids"])


def test_echo_is_the_prompts_text_then_the_outputs_and_logprobs_tokens_keep_their_space(server, tokenizer, words):
    """lm-eval's shape (token ids, echo, logprobs): every token's text, "▁" as a space where the engine
    scored it (the first prompt token, unscored, decodes as itself: <s>); the texts add up to the text."""
    prompt_ids = tokenizer.encode(PROMPT).ids  # <s> ▁the ▁cat
    request = body(server, words, prompt=prompt_ids, echo=True, logprobs=1, max_tokens=3)
    for text, ids, choices in (
        (lambda c: (c["text"], c["token_ids"], [c]))(server.post("/v1/completions", request)[1]["choices"][0]),
        streamed(server, "/v1/completions", request),
    ):
        assert text == tokenizer.decode(prompt_ids, skip_special_tokens=False) + in_context(tokenizer, prompt_ids, ids)
        assert text.startswith("<s> the cat ")
        tokens = [t for c in choices for t in c["logprobs"]["tokens"]]
        assert tokens == ["<s>"] + [tokenizer.id_to_token(t).replace("\u2581", " ") for t in prompt_ids[1:] + ids]
        assert "".join(tokens) == text
        offsets = [o for c in choices for o in c["logprobs"]["text_offset"]]
        assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]


def test_chat_content_and_logprobs_read_as_decoded_after_the_prompt(server, tokenizer, words):
    prompt_ids = server.post("/tokenize", {"messages": MESSAGES})[1]["tokens"]
    request = body(server, words, messages=MESSAGES, logprobs=True, top_logprobs=2)
    status, out = server.post("/v1/chat/completions", request)
    assert status == 200, out
    [choice] = out["choices"]
    want = in_context(tokenizer, prompt_ids, choice["token_ids"])
    assert choice["message"]["content"] == want and want.startswith(" ")
    content = choice["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == want
    assert all(c["bytes"] == list(c["token"].encode()) for c in content)
    text, ids, _ = streamed(server, "/v1/chat/completions", request)
    assert (text, ids) == (want, choice["token_ids"])


def test_a_stop_string_may_begin_with_the_outputs_first_space(server, tokenizer, words):
    """Only the output's text is searched, and its first word has its space: " word" stops at once."""
    status, out = server.post("/v1/completions", body(server, words, prompt=PROMPT))
    first = tokenizer.id_to_token(out["choices"][0]["token_ids"][0]).replace("\u2581", " ")
    for stream in (False, True):
        request = body(server, words, prompt=PROMPT, stop=[first])
        if stream:
            text, ids, choices = streamed(server, "/v1/completions", request)
            reason = choices[-1]["finish_reason"]
        else:
            [choice] = server.post("/v1/completions", request)[1]["choices"]
            text, ids, reason = choice["text"], choice["token_ids"], choice["finish_reason"]
        assert (text, ids, reason) == ("", out["choices"][0]["token_ids"][:1], "stop")
