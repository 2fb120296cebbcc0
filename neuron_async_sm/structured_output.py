"""Structured output: a request's grammar (JSON schema, regex, choice, Lark) as an llguidance matcher.

The scheduler owns the matchers (docs/structured-output.md). A request's matcher takes the tokens its
client receives, in order, and nothing else; the token bitmask of a step (int32 `[rows, ceil(V/32)]`,
bit `t % 32` of word `t // 32` set: token `t` allowed) is filled from the matchers as they are when
the mask is built. Whether they hold every token yet is the async machine's question (`mask_waits`).

llguidance is imported when the first grammar is compiled: an engine that never sees one never loads it.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from neuron_async_sm.sampling_params import InvalidRequestError

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

KINDS = ("json", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint on a request's output (vLLM's `structured_outputs`).

    json: a JSON schema (a dict or its text), or True for any JSON object (`json_object`);
    regex: the whole output matches it; choice: the output is one of these strings;
    grammar: a Lark grammar in llguidance's dialect. `param`: the request field an error names
    (None: `structured_outputs.<kind>`).
    """

    json: dict | str | bool | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    param: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                f"structured_outputs: exactly one of {', '.join(KINDS)} must be given, got {given or 'none'}"
            )
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not all(isinstance(c, str) for c in self.choice):
                raise InvalidRequestError(f"structured_outputs.choice: must be a list of strings, got {self.choice!r}")
            if not self.choice:
                raise InvalidRequestError("structured_outputs.choice: must not be empty")
            object.__setattr__(self, "choice", tuple(self.choice))
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and not isinstance(value, str):
                raise InvalidRequestError(f"structured_outputs.{kind}: must be a string, got {type(value).__name__}")
        if self.json is not None and not isinstance(self.json, (dict, str, bool)):
            raise InvalidRequestError(f"structured_outputs.json: must be a JSON schema object, got {self.json!r}")

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    def grammar_text(self) -> str:
        """The llguidance grammar (not yet checked: `GrammarCompiler.matcher` checks it)."""
        from llguidance import LLMatcher  # noqa: PLC0415 (loaded with the first grammar)

        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.grammar is not None:
            return LLMatcher.grammar_from_lark(self.grammar)
        if self.choice is not None:
            # JSON string literals are Lark string literals: every choice is matched byte for byte.
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        schema: Any = {"type": "object"} if self.json is True else self.json
        try:
            # whitespace_flexible off: the compact form, so bounded schemas end within max_tokens.
            return LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        except ValueError as exc:
            raise InvalidRequestError(f"{self.error_field}: {exc}") from exc

    @property
    def error_field(self) -> str:
        return self.param or f"structured_outputs.{self.kind}"


class GrammarCompiler:
    """The model's tokenizer as llguidance sees it, and the grammars checked against it (cached by text)."""

    def __init__(self, tokenizer_json: str | None, *, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size  # the model's: the bitmask covers every logit, past the tokenizer's too
        self.eos_token_ids = list(eos_token_ids)
        self.words = (vocab_size + 31) // 32  # the bitmask's width W
        self._tokenizer: LLTokenizer | None = None
        self._checked: dict[str, str] = {}  # grammar text -> "" (valid) or llguidance's message

    def tokenizer(self) -> LLTokenizer:
        if self._tokenizer is None:
            if self.tokenizer_json is None:
                raise InvalidRequestError("structured_outputs: the model has no tokenizer.json to build a grammar over")
            from llguidance import LLTokenizer  # noqa: PLC0415

            try:
                self._tokenizer = LLTokenizer(
                    self.tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                )
            except ValueError as exc:  # e.g. a WordLevel tokenizer without a byte decoder
                raise InvalidRequestError(
                    f"structured_outputs: the model's tokenizer.json cannot carry a grammar ({exc})"
                ) from exc
        return self._tokenizer

    def matcher(self, given: StructuredOutputsParams | dict) -> LLMatcher:
        """A fresh matcher for one request; InvalidRequestError naming the field where it does not compile."""
        from llguidance import LLMatcher  # noqa: PLC0415

        params = as_structured_outputs(given)
        text = params.grammar_text()
        try:
            tokenizer = self.tokenizer()
        except InvalidRequestError as exc:  # named for the field this request gave
            raise InvalidRequestError(f"{params.error_field}: {str(exc).split(': ', 1)[1]}") from exc
        problem = self._checked.get(text)
        if problem is None:
            is_error, messages = LLMatcher.validate_grammar_with_warnings(text, tokenizer)
            problem = self._checked[text] = "; ".join(messages) if is_error else ""
        if problem:
            raise InvalidRequestError(f"{params.error_field}: {problem}")
        matcher = LLMatcher(tokenizer, text, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"{params.error_field}: {matcher.get_error()}")
        return matcher

    def draft_bitmask(self, matcher: LLMatcher, drafts: Sequence[int], width: int) -> tuple[list[int], np.ndarray]:
        """Speculative decoding: the grammar-valid prefix of a row's `drafts` (vLLM's `validate_tokens`),
        and its mask int32 `[width, W]`: row j from the state after drafts 0..j-1, so row j constrains
        the token sampled at the position that verifies draft j (or, past the last one, the bonus); rows
        past that allow every token (nothing sampled there is emitted). The matcher is left as it was
        (rolled back): only emitted tokens advance a grammar."""
        from llguidance.numpy import fill_next_token_bitmask  # noqa: PLC0415

        valid = list(drafts[: matcher.validate_tokens(list(drafts))]) if drafts else []
        out = np.full((width, self.words), -1, dtype=np.int32)  # [width, W]
        fill_next_token_bitmask(matcher, out, 0)
        for j, token in enumerate(valid):
            assert matcher.consume_token(token), "a validated draft is accepted"
            fill_next_token_bitmask(matcher, out, j + 1)
        if valid:
            matcher.rollback(len(valid))
        return valid, out

    def bitmask(self, matchers: Sequence[LLMatcher]) -> np.ndarray:
        """int32 `[len(matchers), W]`: row i allows the tokens matcher i accepts next."""
        from llguidance.numpy import fill_next_token_bitmask  # noqa: PLC0415

        out = np.full((len(matchers), self.words), -1, dtype=np.int32)  # [M, W]
        for i, matcher in enumerate(matchers):
            fill_next_token_bitmask(matcher, out, i)
        return out


def dead_end(matcher: LLMatcher, row: np.ndarray, ruled_out: Collection[int], why: str) -> str | None:
    """Why a request cannot sample its next token under its grammar, or None when it can.

    `row`: its bitmask row, int32 `[W]`, as the matcher filled it; `ruled_out`: tokens the request
    itself may not take now, although the grammar allows them (`why` says which rule: min_tokens
    holding back its stop tokens, or ignore_eos, under which EOS does not end it).
    """
    if matcher.is_error():
        return f"structured output: the grammar failed ({matcher.get_error()})"
    left = row.view(np.uint32).copy()  # [W]
    for token in ruled_out:
        left[token // 32] &= ~np.uint32(1 << (token % 32))
    if left.any():
        return None
    allowed = [t for t in ruled_out if row.view(np.uint32)[t // 32] >> np.uint32(t % 32) & 1]
    if not allowed:
        return "structured output: the grammar allows no token here (a dead end)"
    return f"structured output: the grammar allows only token(s) {sorted(allowed)} here, and {why}"


@dataclass(frozen=True)
class GrammarBitmask:
    """One step's token bitmask, row i for request `req_ids[i]`. Keyed by request id: the worker
    scatters it into its own row order (hazard: mask ownership, `MCMaskByRow`)."""

    req_ids: tuple[str, ...]
    bitmask: np.ndarray  # int32 [len(req_ids), W]; speculative decoding: [len(req_ids), 1 + k, W]
    grammar_tokens: tuple[int, ...]  # per row: tokens its grammar had accepted when the mask was built

    def rows(self, order: Sequence[str], num_rows: int) -> np.ndarray:
        """int32 `[num_rows, W]` (speculative: `[num_rows, 1 + k, W]`) in the batch's row `order` (rows
        past it, padding: all allowed)."""
        out = np.full((num_rows, *self.bitmask.shape[1:]), -1, dtype=np.int32)  # [B, W] or [B, 1 + k, W]
        index = {req_id: i for i, req_id in enumerate(self.req_ids)}
        for row, req_id in enumerate(order):
            i = index.get(req_id)
            if i is not None:
                out[row] = self.bitmask[i]
        return out


def as_structured_outputs(value: object) -> StructuredOutputsParams:
    """`SamplingParams.structured_outputs` as given: the params, or a dict of their fields."""
    if isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - {*KINDS, "json_object"})
        if unknown:
            raise InvalidRequestError(f"structured_outputs: unknown field(s) {unknown}; known: {', '.join(KINDS)}")
        fields = dict(value)
        if fields.pop("json_object", None):  # vLLM's own spelling of json=True
            fields["json"] = fields.get("json") or True
        return StructuredOutputsParams(**fields)
    raise InvalidRequestError(f"structured_outputs: must be an object, got {type(value).__name__}")
