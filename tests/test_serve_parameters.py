"""Every parameter of OpenAI's completions and chat schemas (the `openai` SDK's own lists) and of vLLM
0.33's extensions to them is honoured or refused with a 400 naming it; none is silently ignored.

PARAMETERS below is the one place that says which: a parameter implemented later moves from REFUSED
to HONOURED with the check that shows it taking effect, and the README's parameter table must say the
same (checked here too). Each honoured parameter is sent at a non-neutral value and its effect checked
against a greedy baseline; each refused one is sent and must get a 400 whose `param` is its name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.serve_harness import ServerProcess, serve_fixtures, write_text_model

Call = Callable[..., dict]  # call(**fields): the 200 answer to the base request plus `fields`

HONOURED, ACCEPTED, REFUSED = "honoured", "accepted", "refused"
LONG = 48  # output tokens of the checks that need the model's eos to come up
EOS = 54  # the checkpoint's eos token (the word `w54`)
BOTH = ("completions", "chat")


@dataclass(frozen=True)
class Param:
    status: str  # HONOURED, ACCEPTED (valid, no effect on the output: OpenAI's `user`) or REFUSED
    value: object = None  # REFUSED: a non-neutral value that must be refused by name
    check: Callable[[Call, dict], None] | None = None  # HONOURED: (call, greedy answer) -> asserts its effect
    endpoints: tuple[str, ...] = BOTH
    chat_value: object = None  # REFUSED on chat, when its value differs
    chat_refused: bool = False  # honoured on completions, REFUSED (with `value`) on chat


def tokens(answer: dict) -> list[list[int]]:
    return [c["token_ids"] for c in answer["choices"]]


def text(answer: dict, i: int = 0) -> str:
    choice = answer["choices"][i]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def _sampled_differs(call: Call, greedy: dict) -> None:
    assert tokens(call(temperature=2.0, seed=3)) != tokens(greedy)


def _seed(call: Call, greedy: dict) -> None:
    assert tokens(call(temperature=2.0, seed=3)) == tokens(call(temperature=2.0, seed=3))
    assert tokens(call(temperature=2.0, seed=3)) != tokens(call(temperature=2.0, seed=4))


def _stop(call: Call, greedy: dict) -> None:
    second = text(greedy).split()[1]
    answer = call(stop=[second])
    assert answer["choices"][0]["finish_reason"] == "stop" and text(answer) == text(greedy).split(second)[0]


def _include_stop(call: Call, greedy: dict) -> None:
    second = text(greedy).split()[1]
    answer = call(stop=[second], include_stop_str_in_output=True)
    assert text(answer) == text(greedy).split(second)[0] + second


def _spaces_between_special_tokens(call: Call, greedy: dict) -> None:
    """Special tokens in a row (the eos, forced), kept in the text: spaced, or joined when off (vLLM's)."""
    forced = dict(logit_bias={str(EOS): 100.0}, ignore_eos=True, skip_special_tokens=False)
    assert text(call(**forced)) == f" w{EOS}" * 4
    assert text(call(**forced, spaces_between_special_tokens=False)) == f" w{EOS}" + f"w{EOS}" * 3


def _stop_token_ids(call: Call, greedy: dict) -> None:
    answer = call(stop_token_ids=[tokens(greedy)[0][1]])
    assert tokens(answer) == [tokens(greedy)[0][:2]] and answer["choices"][0]["finish_reason"] == "stop"


def _ignore_eos(call: Call, greedy: dict) -> None:
    assert call(max_tokens=LONG)["choices"][0]["finish_reason"] == "stop"  # the model does emit its eos
    assert call(max_tokens=LONG, ignore_eos=True)["usage"]["completion_tokens"] == LONG


def _skip_special_tokens(call: Call, greedy: dict) -> None:
    kept, skipped = (call(max_tokens=LONG, ignore_eos=True, skip_special_tokens=skip) for skip in (False, True))
    assert EOS in tokens(kept)[0] and tokens(kept) == tokens(skipped)
    assert f"w{EOS}" in text(kept).split() and f"w{EOS}" not in text(skipped).split()


def _stream(call: Call, greedy: dict) -> None:
    lines = call(stream=True)["sse"]
    pieces = [json.loads(line)["choices"] for line in lines[:-1]]
    assert lines[-1] == "[DONE]" and [t for ch in pieces for c in ch for t in c["token_ids"]] == tokens(greedy)[0]


def _stream_options(call: Call, greedy: dict) -> None:
    lines = call(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})["sse"]
    chunks = [json.loads(line) for line in lines[:-1]]
    with_tokens = [c for c in chunks if c["choices"] and c["choices"][0]["token_ids"]]
    assert with_tokens and all(c["usage"] is not None for c in with_tokens)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == greedy["usage"]


def _return_token_ids(call: Call, greedy: dict) -> None:
    assert call(return_token_ids=False)["choices"][0]["token_ids"] is None


def _penalty(call: Call, **penalty: float) -> None:
    """Over LONG tokens greedy repeats words; a penalty on them changes the output."""
    plain = call(max_tokens=LONG, ignore_eos=True)
    assert tokens(call(max_tokens=LONG, ignore_eos=True, **penalty)) != tokens(plain)


def _logit_bias(call: Call, greedy: dict) -> None:
    first = tokens(greedy)[0][0]
    assert tokens(call(logit_bias={str(first): -100.0}))[0][0] != first
    assert tokens(call(logit_bias={"7": 100.0}))[0] == [7] * 4


def _min_tokens(call: Call, greedy: dict) -> None:
    stopped = call(max_tokens=LONG)["usage"]["completion_tokens"]  # the model's eos ends it (_ignore_eos)
    held = call(max_tokens=LONG, min_tokens=stopped + 2)
    assert held["usage"]["completion_tokens"] >= stopped + 2 and EOS not in tokens(held)[0][: stopped + 2]


def _echo(call: Call, greedy: dict) -> None:
    if "message" in greedy["choices"][0]:  # chat (vLLM's): the last message first when its role is the reply's
        assert text(call(echo=True)) == text(greedy)  # the last message is the user's
        assert text(call(echo=True, add_generation_prompt=False)).startswith("w5 w6")
        return
    assert text(call(echo=True)) == "w12 w13 w14 w15" + text(greedy)  # the prompt as written, then the output


def _prompt_logprobs(call: Call, greedy: dict) -> None:
    """vLLM's shape: per prompt token (None for the first) a map of token id to logprob, rank and
    decoded_token, the prompt's own token first (tests/test_serve_logprobs.py: the values)."""
    answer = call(prompt_logprobs=2)
    assert tokens(answer) == tokens(greedy)
    chat = "message" in greedy["choices"][0]  # chat: in the response (vLLM's), not the choice
    positions = answer["prompt_logprobs"] if chat else answer["choices"][0]["prompt_logprobs"]
    assert len(positions) == answer["usage"]["prompt_tokens"] and positions[0] is None
    for entries in positions[1:]:
        first = next(iter(entries.values()))
        assert first["logprob"] <= 0 and first["rank"] >= 1
        assert 2 <= len(entries) <= 3 and {1, 2} <= {e["rank"] for e in entries.values()}
    if not chat:
        assert [next(iter(e.values()))["decoded_token"] for e in positions[1:]] == ["w12", "w13", "w14", "w15"]
    else:  # echo with top_logprobs asks for them too (vLLM's)
        assert len(call(echo=True, logprobs=True, top_logprobs=1)["prompt_logprobs"]) == len(positions)
    assert "prompt_logprobs" not in greedy or greedy["prompt_logprobs"] is None


def _return_tokens_as_token_ids(call: Call, greedy: dict) -> None:
    ids = tokens(greedy)[0]
    if "message" in greedy["choices"][0]:
        content = call(logprobs=True, return_tokens_as_token_ids=True)["choices"][0]["logprobs"]["content"]
        assert [e["token"] for e in content] == [f"token_id:{t}" for t in ids]
        return
    logprobs = call(logprobs=1, return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in ids]
    assert all(all(k.startswith("token_id:") for k in top) for top in logprobs["top_logprobs"])


def _truncate_prompt_tokens(call: Call, greedy: dict) -> None:
    cut = call(truncate_prompt_tokens=2)
    assert cut["usage"]["prompt_tokens"] == 2
    if "message" not in greedy["choices"][0]:  # the last two tokens, as if sent alone
        alone = call(prompt="w14 w15", add_special_tokens=False)
        assert tokens(cut) == tokens(alone) != tokens(greedy)
    assert call(truncate_prompt_tokens=-1)["usage"] == greedy["usage"]  # max_model_len - 1: nothing cut
    if "message" not in greedy["choices"][0]:  # truncation_side "right": the first two, <s> w12
        assert tokens(call(truncate_prompt_tokens=2, truncation_side="right")) == tokens(call(prompt="w12"))
    # a prompt far longer than the context fits once truncated (refused unread without it)
    long = "w12 " * 5000
    body = {"messages": [{"role": "user", "content": long}]} if "message" in greedy["choices"][0] else {"prompt": long}
    assert call(truncate_prompt_tokens=-1, max_tokens=1, **body)["usage"]["prompt_tokens"] == 95


def _logprobs(call: Call, greedy: dict) -> None:
    """Each output token's logprob (tests/test_serve_logprobs.py checks the values against transformers)."""
    if "message" in greedy["choices"][0]:  # chat: logprobs=true
        content = call(logprobs=True)["choices"][0]["logprobs"]["content"]
        assert len(content) == 4 and all(e["logprob"] <= 0 and e["top_logprobs"] == [] for e in content)
        return
    logprobs = call(logprobs=2)["choices"][0]["logprobs"]
    assert len(logprobs["token_logprobs"]) == 4 and all(lp <= 0 for lp in logprobs["token_logprobs"])
    assert all(1 <= len(top) <= 3 for top in logprobs["top_logprobs"])  # the chosen token and the top 2


def _top_logprobs(call: Call, greedy: dict) -> None:
    content = call(logprobs=True, top_logprobs=2)["choices"][0]["logprobs"]["content"]
    assert [len(e["top_logprobs"]) for e in content] == [2] * 4


def _allowed_token_ids(call: Call, greedy: dict) -> None:
    only = tokens(call(allowed_token_ids=[7, 9]))[0]
    assert set(only) <= {7, 9} and only != tokens(greedy)[0]


def _bad_words(call: Call, greedy: dict) -> None:
    """A one-word bad word is never sampled; a two-word one only loses its second word right after its first."""
    first, second = text(greedy).split()[:2]
    ids = tokens(greedy)[0]
    assert tokens(call(bad_words=[first]))[0][0] != ids[0]
    held = tokens(call(bad_words=[f"{first} {second}"]))[0]
    assert held[0] == ids[0] and held[1] != ids[1]


def _add_special_tokens(call: Call, greedy: dict, *, chat: bool = False) -> None:
    flipped = call(add_special_tokens=chat)  # completions: off (its default is on); chat: on
    assert flipped["usage"]["prompt_tokens"] == greedy["usage"]["prompt_tokens"] + (1 if chat else -1)


PARAMETERS: dict[str, Param] = {
    # exercised by every request
    "model": Param(HONOURED, check=lambda call, greedy: None),
    "prompt": Param(HONOURED, check=lambda call, greedy: None, endpoints=("completions",)),
    "messages": Param(HONOURED, check=lambda call, greedy: None, endpoints=("chat",)),
    # OpenAI's
    "max_tokens": Param(
        HONOURED, check=lambda call, greedy: call(max_tokens=2)["usage"]["completion_tokens"] == 2 or _fail()
    ),
    "max_completion_tokens": Param(
        HONOURED,
        check=lambda call, greedy: call(max_completion_tokens=2)["usage"]["completion_tokens"] == 2 or _fail(),
        endpoints=("chat",),
    ),
    "temperature": Param(HONOURED, check=_sampled_differs),
    "top_p": Param(HONOURED, check=lambda c, g: tokens(c(temperature=2.0, seed=3, top_p=1e-9)) == tokens(g) or _fail()),
    "seed": Param(HONOURED, check=_seed),
    "stop": Param(HONOURED, check=_stop),
    "n": Param(HONOURED, check=lambda call, greedy: tokens(call(n=2)) == tokens(greedy) * 2 or _fail()),
    "best_of": Param(
        HONOURED,
        check=lambda call, greedy: len(call(n=2, best_of=2)["choices"]) == 2 or _fail(),
        endpoints=("completions",),
    ),  # at n; other values refused (tests/test_serve_parallel_sampling.py)
    "stream": Param(HONOURED, check=_stream),
    "stream_options": Param(HONOURED, check=_stream_options),
    "user": Param(ACCEPTED),  # as vLLM: an end-user id for the operator's own records
    "echo": Param(HONOURED, check=_echo),
    "logprobs": Param(HONOURED, check=_logprobs),
    "top_logprobs": Param(HONOURED, check=_top_logprobs, endpoints=("chat",)),
    "frequency_penalty": Param(HONOURED, check=lambda call, greedy: _penalty(call, frequency_penalty=2.0)),
    "presence_penalty": Param(HONOURED, check=lambda call, greedy: _penalty(call, presence_penalty=2.0)),
    "logit_bias": Param(HONOURED, check=_logit_bias),
    "suffix": Param(REFUSED, "w6", endpoints=("completions",)),
    "response_format": Param(HONOURED, check=lambda call, greedy: _no_grammar_here(call, "response_format")),
    **{
        name: Param(REFUSED, 1, endpoints=("chat",))
        for name in (
            "audio",
            "function_call",
            "functions",
            "metadata",
            "modalities",
            "moderation",
            "parallel_tool_calls",
            "prediction",
            "prompt_cache_key",
            "prompt_cache_options",
            "prompt_cache_retention",
            "reasoning_effort",
            "safety_identifier",
            "service_tier",
            "store",
            "tool_choice",
            "tools",
            "verbosity",
            "web_search_options",
        )
    },
    # vLLM's extensions
    "top_k": Param(HONOURED, check=lambda c, g: tokens(c(temperature=2.0, seed=3, top_k=1)) == tokens(g) or _fail()),
    "stop_token_ids": Param(HONOURED, check=_stop_token_ids),
    "ignore_eos": Param(HONOURED, check=_ignore_eos),
    "return_token_ids": Param(HONOURED, check=_return_token_ids),
    "include_stop_str_in_output": Param(HONOURED, check=_include_stop),
    "skip_special_tokens": Param(HONOURED, check=_skip_special_tokens),
    "request_id": Param(HONOURED, check=lambda call, greedy: call(request_id="r-7")["id"].endswith("-r-7") or _fail()),
    "add_special_tokens": Param(HONOURED, check=_add_special_tokens),
    "add_generation_prompt": Param(
        HONOURED,
        check=lambda c, g: (
            c(add_generation_prompt=False)["usage"]["prompt_tokens"] == g["usage"]["prompt_tokens"] - 1 or _fail()
        ),
        endpoints=("chat",),
    ),
    "use_beam_search": Param(REFUSED, True),
    "length_penalty": Param(REFUSED, 0.5),
    "priority": Param(REFUSED, 1),
    "spaces_between_special_tokens": Param(HONOURED, check=_spaces_between_special_tokens),
    "min_p": Param(HONOURED, check=lambda c, g: tokens(c(temperature=2.0, seed=3, min_p=1.0)) == tokens(g) or _fail()),
    "min_tokens": Param(HONOURED, check=_min_tokens),
    "repetition_penalty": Param(HONOURED, check=lambda call, greedy: _penalty(call, repetition_penalty=2.0)),
    "prompt_logprobs": Param(HONOURED, check=_prompt_logprobs),
    "return_tokens_as_token_ids": Param(HONOURED, check=_return_tokens_as_token_ids),
    "truncate_prompt_tokens": Param(HONOURED, check=_truncate_prompt_tokens),
    "truncation_side": Param(HONOURED, check=lambda call, greedy: None),  # in _truncate_prompt_tokens
    "allowed_token_ids": Param(HONOURED, check=_allowed_token_ids),
    "bad_words": Param(HONOURED, check=_bad_words),
    "structured_outputs": Param(HONOURED, check=lambda call, greedy: _no_grammar_here(call, "structured_outputs")),
    "prompt_embeds": Param(REFUSED, "AAAA", endpoints=("completions",)),
    **{
        name: Param(REFUSED, 1)
        for name in (
            "cache_salt",
            "ec_transfer_params",
            "kv_transfer_params",
            "logprob_token_ids",
            "mm_payload",
            "repetition_detection",
            "return_mm_kwargs",
            "return_token_offsets",
            "return_weight_versions",
            "routed_experts_prompt_start",
            "session_id",
            "stream_interval",
            "thinking_token_budget",
            "vllm_xargs",
            "watermarking",
        )
    },
    **{
        name: Param(REFUSED, 1, endpoints=("chat",))
        for name in (
            "chat_template",
            "chat_template_kwargs",
            "continue_final_message",
            "documents",
            "include_reasoning",
            "media_io_kwargs",
            "mm_processor_kwargs",
            "return_prompt_text",
        )
    },
}
# vLLM 0.33's fields beyond OpenAI's (vllm/entrypoints/openai/{completion,chat_completion}/protocol.py,
# CompletionRequest and ChatCompletionRequest); `echo` on chat is vLLM's own (prepend the last message).
VLLM_COMPLETION_EXTRAS = {
    "add_special_tokens", "allowed_token_ids", "bad_words", "cache_salt", "ec_transfer_params", "ignore_eos",
    "include_stop_str_in_output", "kv_transfer_params", "length_penalty", "logprob_token_ids", "min_p", "min_tokens",
    "mm_payload", "priority", "prompt_embeds", "prompt_logprobs", "repetition_detection", "repetition_penalty",
    "request_id", "response_format", "return_mm_kwargs", "return_token_ids", "return_token_offsets",
    "return_tokens_as_token_ids", "return_weight_versions", "routed_experts_prompt_start", "session_id",
    "skip_special_tokens", "spaces_between_special_tokens", "stop_token_ids", "stream", "stream_interval",
    "structured_outputs", "thinking_token_budget", "top_k", "truncate_prompt_tokens", "truncation_side",
    "use_beam_search", "vllm_xargs", "watermarking",
}  # fmt: skip
VLLM_CHAT_EXTRAS = (VLLM_COMPLETION_EXTRAS - {"response_format", "prompt_embeds"}) | {
    "add_generation_prompt", "chat_template", "chat_template_kwargs", "continue_final_message", "documents", "echo",
    "include_reasoning", "media_io_kwargs", "mm_processor_kwargs", "return_prompt_text",
}  # fmt: skip


def _no_grammar_here(call: Call, name: str) -> None:
    """Structured output is read and compiled against the model's tokenizer; this checkpoint's
    whitespace WordLevel tokenizer has no byte decoder, so the grammar is refused naming the field.
    Its effect on a tokenizer that can spell JSON: tests/test_serve_structured_output.py."""
    value = {"type": "json_object"} if name == "response_format" else {"regex": "w5"}
    try:
        call(**{name: value})
    except AssertionError as exc:  # call() asserts a 200; the 400's body is in its (shortened) message
        assert "400 == 200" in str(exc) and f"'param': '{name}" in str(exc), exc
    else:
        _fail()


def _fail() -> None:
    raise AssertionError("the parameter had no effect")


def schema(endpoint: str) -> set[str]:
    if endpoint == "completions":
        from openai.types.completion_create_params import CompletionCreateParamsBase as Params

        return set(Params.__annotations__) | VLLM_COMPLETION_EXTRAS
    from openai.types.chat.completion_create_params import CompletionCreateParamsBase as Params

    return set(Params.__annotations__) | VLLM_CHAT_EXTRAS


def write_model(path: Path) -> Path:
    """The text model, its eos a word both base requests' greedy runs reach after their first 4 tokens
    and before LONG; it is a special token, as eos tokens are. As most tokenizers do, a text gets <s> first."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    model = write_text_model(path, eos_token_id=EOS)
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>", f"w{EOS}"])
    tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.save(str(model / "tokenizer.json"))
    return model


FLAGS = ["--device", "cpu-inprocess", "--dtype", "float64", "--max-model-len", "96", "--max-num-seqs", "4"]
model, server, _ = serve_fixtures(*FLAGS, write_model=write_model)


def base(server: ServerProcess, endpoint: str) -> tuple[str, dict]:
    common = {"model": server.model, "max_tokens": 4, "temperature": 0.0, "return_token_ids": True}
    if endpoint == "completions":
        return "/v1/completions", {**common, "prompt": "w12 w13 w14 w15"}
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": "w5 w6"}]}


def test_the_table_covers_both_schemas_exactly():
    for endpoint in BOTH:
        listed = {name for name, p in PARAMETERS.items() if endpoint in p.endpoints}
        assert listed == schema(endpoint), (endpoint, listed ^ schema(endpoint))


@pytest.mark.parametrize("endpoint", BOTH)
def test_every_parameter_is_honoured_or_refused_by_name(server, endpoint):
    path, request = base(server, endpoint)

    def call(**fields) -> dict:
        body = {**request, **fields}
        if body.get("stream"):
            return {"sse": server.sse(path, body)}
        status, answer = server.post(path, body)
        assert status == 200, (fields, answer)
        return answer

    greedy = call()
    assert greedy["usage"]["completion_tokens"] == 4 and len(set(text(greedy).split())) == 4, greedy
    failures = []
    for name, param in PARAMETERS.items():
        if endpoint not in param.endpoints:
            continue
        try:
            if param.status == REFUSED or (endpoint == "chat" and param.chat_refused):
                value = param.chat_value if endpoint == "chat" and param.chat_value is not None else param.value
                status, answer = server.post(path, {**request, name: value})
                assert status == 400 and answer["error"]["param"] == name, answer
            elif param.status == ACCEPTED:
                assert tokens(call(**{name: "someone"})) == tokens(greedy)
            elif name == "add_special_tokens":
                _add_special_tokens(call, greedy, chat=endpoint == "chat")
            else:
                param.check(call, greedy)  # type: ignore[misc]
        except AssertionError as exc:
            failures.append(f"{name}: {exc}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("allowed_token_ids", [5, 4096], "4096 is outside the vocabulary"),
        ("allowed_token_ids", [], "must not be empty"),
        ("allowed_token_ids", [-1], "non-negative"),
        ("bad_words", [""], "non-empty strings"),
        ("truncate_prompt_tokens", 97, "maximum context length of 96"),
        ("truncate_prompt_tokens", -2, "must be -1 or"),
        ("prompt_logprobs", 21, "--max-logprobs"),
    ],
)
def test_bad_values_of_the_token_lists_are_refused_naming_the_field(server, field, value, says):
    path, request = base(server, "completions")
    status, answer = server.post(path, {**request, field: value})
    assert status == 400 and answer["error"]["param"] == field and says in answer["error"]["message"], answer


def test_the_readme_table_says_the_same():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme.split("What the request bodies take:", 1)[1].split("\n\n", 2)[1]
    rows = [line.split("|")[1:3] for line in table.splitlines()[2:]]
    status_of = {}
    for names, status in rows:
        for name in re.findall(r"`([a-z_]+)`", names):
            status_of.setdefault(name, status.strip().split(":")[0].split(" ")[0])
    wrong = {name: (p.status, status_of.get(name)) for name, p in PARAMETERS.items() if status_of.get(name) != p.status}
    assert not wrong, wrong
    assert "ignored" not in table


def test_the_openai_client_sends_every_honoured_parameter_at_once(server):
    """The official client, every honoured parameter in one call (vLLM's through `extra_body`)."""
    client = server.client()
    sampled = dict(temperature=0.5, top_p=0.9, seed=3, stop=["w60"], n=2, user="someone")
    vllm = dict(top_k=5, stop_token_ids=[59], ignore_eos=True, return_token_ids=True, skip_special_tokens=False)
    vllm.update(include_stop_str_in_output=True)
    vllm.update(allowed_token_ids=[59, 60, 61, 62], bad_words=["w61"], truncate_prompt_tokens=2)
    out = client.completions.create(
        model=server.model,
        prompt="w11 w12 w13",
        max_tokens=4,
        best_of=2,
        logprobs=1,
        extra_body={
            **vllm,
            "add_special_tokens": False,
            "request_id": "all-1",
            "prompt_logprobs": 1,
            "return_tokens_as_token_ids": True,
        },
        **sampled,
    )
    assert out.id.endswith("-all-1") and [c.index for c in out.choices] == [0, 1], out
    assert all(c.token_ids for c in out.choices) and out.usage.prompt_tokens == 2
    for c in out.choices:
        assert set(c.token_ids) <= {59, 60, 62} and c.logprobs.tokens[0].startswith("token_id:")
        assert c.prompt_logprobs[0] is None and len(c.prompt_logprobs) == 2
    chunks = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "w12 w13"}],
        max_completion_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={
            **vllm,
            "add_generation_prompt": False,
            "add_special_tokens": True,
            "request_id": "all-2",
            "echo": True,
        },
        **sampled,
    )
    chunks = list(chunks)
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    assert chunks[-1].usage is not None and chunks[-1].id.endswith("-all-2")
    for index in (0, 1):  # echo: the last message first, then only allowed words
        reply = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == index)
        assert reply.startswith("w12 w13") and set(reply[len("w12 w13") :].split()) <= {"w59", "w60", "w62"}, reply
