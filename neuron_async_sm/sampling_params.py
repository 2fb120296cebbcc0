"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, replace

from neuron_async_sm.errors import NeuronAsyncSMError
from neuron_async_sm.values import is_int, is_number


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
        if not is_int(self.top_k) or self.top_k < 0:
            raise InvalidRequestError(f"top_k: must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise InvalidRequestError(f"seed: must be an integer in [0, 2**63), got {self.seed!r}")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids: must be non-negative integers, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos: must be true or false, got {self.ignore_eos!r}")
        if not is_int(self.n) or self.n < 1:
            raise InvalidRequestError(f"n: must be an integer >= 1, got {self.n!r}")
        if self.seed is not None and self.seed + self.n > 2**63:
            raise InvalidRequestError(f"seed: the children's seeds seed..seed+n-1 must be < 2**63, got {self.seed!r}")

    def children(self) -> list[SamplingParams]:
        """The child requests of n sequences, each of n=1 (vLLM's parallel sampling): child i is seeded
        `seed + i`, so its tokens are those of a request of its own with that seed; unseeded children
        each get their own seed from the engine, as any unseeded request does."""
        if self.n == 1:
            return [self]
        return [replace(self, n=1, seed=None if self.seed is None else self.seed + i) for i in range(self.n)]


def child_request_id(request_id: str, index: int) -> str:
    """The engine request id of the `index`-th child of `request_id` (vLLM's own scheme)."""
    return f"{index}_{request_id}"
