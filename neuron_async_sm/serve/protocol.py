"""The OpenAI wire format the server speaks: request models (validated, unknown fields rejected),
response and streaming-chunk models, and the error body.

Fields OpenAI defines but this engine does not implement are accepted only at their neutral value
(`best_of` unset or `n`): anything else is a 400 naming the field, never a silently different result.
Logprobs are honoured: completions' `logprobs` (with `echo`, the prompt's too) and chat's `logprobs`
/ `top_logprobs`, in vLLM's response shapes (serve/logprobs.py). Extras beyond OpenAI follow vLLM's
names and meanings: `top_k` (-1 or 0: off), `min_p`, `min_tokens`, `repetition_penalty`,
`stop_token_ids`, `ignore_eos`, `allowed_token_ids`, `bad_words`, `return_token_ids`,
`stream_options.continuous_usage_stats`.
Text must be valid Unicode: a lone surrogate ("\\ud800", which JSON can carry) is a 400 naming the field.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from neuron_async_sm.serve.structured_protocol import ResponseFormat, StructuredOutputsField


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"invalid Unicode at character {exc.start}: a lone surrogate") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]

# -- requests ---------------------------------------------------------------------------------------


class _Strict(BaseModel):
    # strict: "10" is not an integer and true is not a number; forbid: a misspelt field is an error.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = True  # vLLM's default once stream_options is given: a last chunk with the usage
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far (with include_usage)

    @property
    def usage_in_every_chunk(self) -> bool:
        return self.include_usage and self.continuous_usage_stats


class _SamplingFields(_Strict):
    model: Text
    temperature: float | None = None  # OpenAI's default is 1
    top_p: float | None = None
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    n: int = 1  # sequences of each prompt: n choices, child i seeded seed + i (SamplingParams.children)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None  # None, 0 and -1: off (vLLM's -1)
    min_p: float = 0.0
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    truncate_prompt_tokens: int | None = None  # keep the prompt's last N tokens (-1: max_model_len - 1)
    truncation_side: Literal["left", "right"] | None = None  # vLLM's: "right" keeps the first N instead
    return_tokens_as_token_ids: bool | None = None  # logprobs' tokens as "token_id:<id>" (vLLM's)
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and its top N
    bad_words: list[Text] = Field(default_factory=list)  # never sampled; the engine tokenizes them (vLLM's rule)
    return_token_ids: bool = False  # each choice carries `token_ids` (always, for a model without a tokenizer)
    skip_special_tokens: bool = True  # decoding the output drops special tokens (vLLM's default)
    spaces_between_special_tokens: bool = True  # False: two added tokens in a row are joined without one
    include_stop_str_in_output: bool = False  # the matched stop string ends the text, rather than being cut
    request_id: Text | None = None  # the response's id is `<prefix>-<request_id>` (vLLM's); else a random one
    # vLLM's, accepted at their neutral value only (see unsupported())
    use_beam_search: bool = False
    length_penalty: float = 1.0
    priority: int = 0
    # structured output (serve/structured_protocol.py): OpenAI's, and vLLM's body field
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None

    logprobs_param: ClassVar[str] = "logprobs"  # the field that asks for logprobs, named in its errors

    @property
    def logprobs_count(self) -> int | None:
        """Top tokens per output token the engine computes (SamplingParams.logprobs); None: none."""
        return None

    @property
    def prompt_logprobs_count(self) -> int | None:
        """Top tokens per prompt token (SamplingParams.prompt_logprobs); None: none."""
        return self.prompt_logprobs

    @property
    def prompt_logprobs_param(self) -> str:
        return "prompt_logprobs"

    def unsupported(self) -> tuple[str, str] | None:
        """(field, message) for the first field set to a value this engine cannot honour."""
        for name, neutral in _NEUTRAL_ONLY.items():
            if getattr(self, name) != neutral:
                return name, f"{name} is not supported (only {json.dumps(neutral)})"
        if any(not key.isdecimal() for key in self.logit_bias or {}):
            return "logit_bias", "logit_bias: keys must be token ids (decimal integers as strings)"
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < -1:
            return "truncate_prompt_tokens", f"must be -1 or an integer >= 1, got {self.truncate_prompt_tokens}"
        if self.truncate_prompt_tokens == 0:
            return "truncate_prompt_tokens", "0 would leave an empty prompt"
        if self.prompt_logprobs is not None and self.stream:  # vLLM's rule
            return "prompt_logprobs", "prompt_logprobs are not available with stream=true"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only for stream=true"  # vLLM refuses it too
        return None

    @property
    def token_bias(self) -> dict[int, float]:
        """logit_bias by token id (JSON keys are strings; `unsupported` checked them)."""
        return {int(key): value for key, value in (self.logit_bias or {}).items()}

    @property
    def top_k_or_off(self) -> int:
        """The engine's top_k: 0 is off; vLLM's -1 means off too (any other negative is the engine's 400)."""
        return 0 if self.top_k in (None, -1) else self.top_k

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def usage_in_every_chunk(self) -> bool:
        return self.stream_options is not None and self.stream_options.usage_in_every_chunk

    @property
    def text_options(self) -> dict[str, bool | int]:
        """How the output is decoded (IncrementalText's options)."""
        return {
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "include_stop": self.include_stop_str_in_output,
            "min_tokens": self.min_tokens,  # a stop string within the first min_tokens tokens does not count
        }

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


Prompt = Text | list[int]  # one prompt: text, or token ids


# vLLM's extension fields this server accepts at the neutral value only: beam search and priority
# scheduling.
_NEUTRAL_ONLY: dict[str, object] = {
    "use_beam_search": False,
    "length_penalty": 1.0,
    "priority": 0,
}

# Fields of OpenAI's and vLLM 0.33's request schemas that this server does not implement and does not
# declare: refused with a 400 naming the field as "not supported" (any other undeclared field is an
# "unknown field"). The parameter table of the README says the same.
NOT_SUPPORTED = frozenset(
    {
        # OpenAI chat
        "audio", "function_call", "functions", "metadata", "modalities", "moderation", "parallel_tool_calls",
        "prediction", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "reasoning_effort",
        "safety_identifier", "service_tier", "store", "tool_choice", "tools", "verbosity", "web_search_options",
        # vLLM's extensions
        "cache_salt", "chat_template", "chat_template_kwargs",
        "continue_final_message", "documents", "ec_transfer_params", "include_reasoning", "kv_transfer_params",
        "logprob_token_ids", "media_io_kwargs", "mm_payload", "mm_processor_kwargs", "prompt_embeds",
        "repetition_detection", "return_mm_kwargs", "return_prompt_text", "return_token_offsets",
        "return_weight_versions", "routed_experts_prompt_start", "session_id",
        "stream_interval", "thinking_token_budget", "vllm_xargs",
        "watermarking",
    }
)  # fmt: skip


class CompletionRequest(_SamplingFields):
    # One prompt, or a batch (a list of texts or of token-id lists): one choice per prompt, `index` its
    # place in the batch, as vLLM answers (lm-eval sends token ids as a batch of one, `[[ids]]`).
    prompt: Text | list[int] | list[Text] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: Text | None = None
    add_special_tokens: bool = True  # vLLM's: a text prompt gets the tokenizer's special tokens (BOS)

    @property
    def prompts(self) -> list[Prompt]:
        """The batch: a lone text or token-id list is a batch of one."""
        if isinstance(self.prompt, str) or not self.prompt or type(self.prompt[0]) is int:
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]

    @property
    def logprobs_count(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs_count(self) -> int | None:
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None  # vLLM: echo with logprobs returns the prompt's too

    @property
    def prompt_logprobs_param(self) -> str:
        return "prompt_logprobs" if self.prompt_logprobs is not None else "logprobs"

    def unsupported(self) -> tuple[str, str] | None:
        if isinstance(self.prompt, list) and not self.prompt:
            return "prompt", "empty prompt"
        if self.best_of is not None and self.best_of < self.n:
            return "best_of", f"must be >= n ({self.n}), got {self.best_of}"
        if self.best_of is not None and self.best_of > self.n:
            # vLLM's V1 engine has no best_of at all (it drops the field); returning the n best of
            # best_of sequences would need their log-probabilities.
            return "best_of", f"best_of > n is not supported (best_of={self.best_of}, n={self.n}); ask for n sequences"
        if self.suffix is not None:
            return "suffix", "suffix is not supported"
        return super().unsupported()


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]
    name: Text | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to max_model_len
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None  # with logprobs: how many candidates per token (0..max_logprobs)
    add_generation_prompt: bool = True  # vLLM extra: the template's cue for the assistant's turn
    add_special_tokens: bool = False  # vLLM extra: the template writes them; True adds the tokenizer's too
    echo: bool = False  # vLLM's: the last message's content before the reply, when its role is the reply's

    logprobs_param: ClassVar[str] = "top_logprobs"

    @property
    def prompt_logprobs_count(self) -> int | None:
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.top_logprobs if self.echo else None  # vLLM's: echo asks for the prompt's too

    @property
    def prompt_logprobs_param(self) -> str:
        return "prompt_logprobs" if self.prompt_logprobs is not None else "top_logprobs"

    @property
    def echoed(self) -> str:
        """What `echo` puts before the reply (vLLM's rule): the last message's text when its role is the
        reply's (`assistant`, or the last message's own role without add_generation_prompt)."""
        last = self.messages[-1]
        if not self.echo or (self.add_generation_prompt and last.role != "assistant"):
            return ""
        return "\n".join(p.text for p in last.content) if isinstance(last.content, list) else last.content

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs not in (None, 0) and not self.logprobs:  # vLLM's rule
            return "top_logprobs", "top_logprobs needs logprobs=true"
        return super().unsupported()

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a text (`prompt`) or a chat (`messages`, rendered with the chat template)."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for a chat (the template has them)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: Text | None = None
    tokens: list[int]


# -- responses --------------------------------------------------------------------------------------


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )


FinishReason = Literal["stop", "length"] | None


class CompletionLogprobs(BaseModel):
    """A completion choice's logprobs: per token its text, where it starts, its logprob and candidates."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: the first prompt token
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class ChatLogprob(BaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatLogprobContent(ChatLogprob):
    top_logprobs: list[ChatLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobContent] | None = None


class PromptLogprob(BaseModel):
    """vLLM's Logprob: one token's at one prompt position."""

    logprob: float
    rank: int | None = None  # 1: the most likely
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None
    # vLLM's: per prompt token (None for the first) its own and the top tokens', keyed by token id
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None  # vLLM's, as a completion choice's


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: FinishReason = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "neuron_async_sm"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- errors -----------------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
