"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from neuron_async_sm.errors import NeuronAsyncSMError
from neuron_async_sm.values import is_int, is_number

MAX_LOGIT_BIAS = 256
"""Most logit_bias entries a request may carry. Each step sends a request's entries to the device
in a fixed-width row (`[rows, width]`), so the cap bounds that input; vLLM sets none and OpenAI
documents none, and the maps clients send (a label set, a few banned words) are far smaller."""
MAX_BAD_WORDS = 128
"""Most token sequences a request's bad_words may become (each word with and without a leading
space): vLLM's VLLM_MAX_NUM_BAD_WORDS default."""


class InvalidRequestError(NeuronAsyncSMError, ValueError):
    """A request the engine rejects on its own; the message names the field. Other requests go on."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops.

    Sampling is a pure function of (logits, seed, output index), so a request yields the same tokens
    whatever batch it runs in. A request without a seed gets one from the engine's seeded generator.
    `n` > 1 asks for n sequences of one prompt: they run as n child requests (`children()`).
    """

    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0  # 1.0 means off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1  # sequences of one prompt (vLLM's parallel sampling); the engine itself runs n=1 only
    # Logits processing (vLLM's meanings; model/logits_processors.py applies them on the device):
    presence_penalty: float = 0.0  # subtracted once from every token already in the output; 0 means off
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output; 0 means off
    repetition_penalty: float = 1.0  # divides (or multiplies, if negative) a prompt or output token's logit; 1 off
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability; 0 means off
    min_tokens: int = 0  # no stop token (EOS, stop_token_ids) before this many outputs
    # token id -> bias added to its logit; kept as (token, bias) pairs in token order (hashable)
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled; None: any
    # Words never to sample (vLLM's): a word's last token is banned when the outputs just before it
    # are the word's other tokens. The engine tokenizes them (`bad_words_token_ids`, vLLM's rule).
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # the words as token sequences; () until tokenized
    # Logprobs (vLLM's meaning): None, none; N >= 0, each sampled token's logprob and the N most likely
    # tokens' (-1: the whole vocabulary). The engine caps N at EngineConfig.max_logprobs.
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for every prompt token but the first (its entry is None)
    # A grammar the output must match (JSON schema, regex, choice, Lark): a StructuredOutputsParams
    # (neuron_async_sm/structured_output.py) or a dict of its fields; None: unconstrained.
    structured_outputs: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise InvalidRequestError(f"stop_token_ids: must be a list of integers, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        if not is_number(self.temperature):
            raise InvalidRequestError(f"temperature: must be a number, got {self.temperature!r}")
        if not self.temperature >= 0:  # also rejects NaN
            raise InvalidRequestError(f"temperature: must be >= 0, got {self.temperature!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise InvalidRequestError(f"top_k: must be an integer >= 1, or 0 or -1 (off), got {self.top_k!r}")
        if self.top_k == -1:  # vLLM's "off"
            object.__setattr__(self, "top_k", 0)
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise InvalidRequestError(f"seed: must be an integer in [0, 2**63), got {self.seed!r}")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids: must be non-negative integers, got {self.stop_token_ids!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < -1):
                raise InvalidRequestError(
                    f"{name}: must be an integer >= 0, or -1 (the whole vocabulary), got {value!r}"
                )
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos: must be true or false, got {self.ignore_eos!r}")
        # structured_outputs (a dict or StructuredOutputsParams) is checked where its grammar is compiled:
        # the scheduler's add_request (structured_output.as_structured_outputs), naming the field.
        if not is_int(self.n) or self.n < 1:
            raise InvalidRequestError(f"n: must be an integer >= 1, got {self.n!r}")
        if self.seed is not None and self.seed + self.n > 2**63:
            raise InvalidRequestError(f"seed: the children's seeds seed..seed+n-1 must be < 2**63, got {self.seed!r}")
        self._check_logits_processing()

    def _check_logits_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_number(value) or not -2 <= value <= 2:
                raise InvalidRequestError(f"{name}: must be a number in [-2, 2], got {value!r}")
        rep = self.repetition_penalty
        if not is_number(rep) or not math.isfinite(rep) or rep <= 0:
            raise InvalidRequestError(f"repetition_penalty: must be a finite number > 0 (1 = off), got {rep!r}")
        if not is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p: must be in [0, 1], got {self.min_p!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens: must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        bias = self.logit_bias
        if isinstance(bias, tuple) and all(isinstance(pair, tuple) and len(pair) == 2 for pair in bias):
            bias = dict(bias)
        if not isinstance(bias, Mapping):
            raise InvalidRequestError(f"logit_bias: must be a map of token id to bias, got {bias!r}")
        if len(bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
        for token, value in bias.items():
            if not is_int(token) or token < 0:
                raise InvalidRequestError(f"logit_bias: token ids must be non-negative integers, got {token!r}")
            if not is_number(value) or not -100 <= value <= 100:
                raise InvalidRequestError(f"logit_bias: bias of token {token} must be in [-100, 100], got {value!r}")
        object.__setattr__(self, "logit_bias", tuple(sorted((token, float(value)) for token, value in bias.items())))
        self._check_token_lists()

    def _check_token_lists(self) -> None:
        allowed = self.allowed_token_ids
        if allowed is not None:
            if isinstance(allowed, (str, bytes, Mapping)) or not hasattr(allowed, "__iter__"):
                raise InvalidRequestError(f"allowed_token_ids: must be a list of token ids, got {allowed!r}")
            allowed = tuple(dict.fromkeys(allowed))
            if not allowed:
                raise InvalidRequestError("allowed_token_ids: must not be empty (leave it out to allow every token)")
            if not all(is_int(t) and t >= 0 for t in allowed):
                raise InvalidRequestError(f"allowed_token_ids: must be non-negative integers, got {list(allowed)!r}")
            object.__setattr__(self, "allowed_token_ids", allowed)
        words = self.bad_words
        if isinstance(words, (str, bytes)) or not hasattr(words, "__iter__"):
            raise InvalidRequestError(f"bad_words: must be a list of strings, got {words!r}")
        words = tuple(dict.fromkeys(words))
        if not all(isinstance(w, str) and w for w in words):
            raise InvalidRequestError(f"bad_words: must be non-empty strings, got {list(words)!r}")
        object.__setattr__(self, "bad_words", words)
        sequences = self.bad_words_token_ids
        if isinstance(sequences, (str, bytes)) or not hasattr(sequences, "__iter__"):
            raise InvalidRequestError(f"bad_words: token sequences must be lists of token ids, got {sequences!r}")
        sequences = tuple(tuple(s) if hasattr(s, "__iter__") else s for s in sequences)
        if not all(isinstance(s, tuple) and s and all(is_int(t) and t >= 0 for t in s) for s in sequences):
            raise InvalidRequestError(
                f"bad_words: token sequences must be non-empty lists of token ids, got {list(sequences)!r}"
            )
        if len(sequences) > MAX_BAD_WORDS:
            raise InvalidRequestError(f"bad_words: at most {MAX_BAD_WORDS} token sequences, got {len(sequences)}")
        object.__setattr__(self, "bad_words_token_ids", sequences)

    @property
    def penalized(self) -> bool:
        """Any of the penalties on: sampling then depends on the request's tokens so far."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def processes_logits(self) -> bool:
        """Anything between the logits and the sampler on (`model/logits_processors.py`)."""
        return (
            self.penalized
            or self.min_p > 0
            or self.min_tokens > 0
            or bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.bad_words or self.bad_words_token_ids)
        )

    def children(self) -> list[SamplingParams]:
        """The child requests of n sequences, each of n=1 (vLLM's parallel sampling): child i is seeded
        `seed + i`, so its tokens are those of a request of its own with that seed; unseeded children
        each get their own seed from the engine, as any unseeded request does."""
        if self.n == 1:
            return [self]
        return [replace(self, n=1, seed=None if self.seed is None else self.seed + i) for i in range(self.n)]


def bad_words_token_ids(
    words: Sequence[str], encode: Callable[[str], list[int]], vocab_size: int
) -> tuple[tuple[int, ...], ...]:
    """The token sequences of `words`, by vLLM's rule (SamplingParams.update_from_tokenizer): each word
    as written (leading spaces dropped), and with one leading space when that starts with another
    token and has as many tokens (a word inside a sentence); `encode` adds no special tokens.
    InvalidRequestError naming bad_words for a word of no tokens, too many sequences, or a token
    outside the vocabulary."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(encode(word.lstrip()))
        if not bare:
            raise InvalidRequestError(f"bad_words: {word!r} tokenizes to no token")
        sequences.append(bare)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            sequences.append(spaced)
        if len(sequences) > MAX_BAD_WORDS:
            raise InvalidRequestError(f"bad_words: more than {MAX_BAD_WORDS} token sequences after tokenization")
    if outside := [t for s in sequences for t in s if t >= vocab_size]:
        raise InvalidRequestError(f"bad_words: token id {outside[0]} is outside the vocabulary [0, {vocab_size})")
    return tuple(sequences)


def child_request_id(request_id: str, index: int) -> str:
    """The engine request id of the `index`-th child of `request_id` (vLLM's own scheme)."""
    return f"{index}_{request_id}"
