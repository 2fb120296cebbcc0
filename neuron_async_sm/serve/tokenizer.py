"""Text for the server: the model directory's `tokenizer.json`, its chat template, and streaming decode.

The chat template is `chat_template.jinja` beside `tokenizer_config.json` (where current
transformers saves it), else the config's `chat_template` (a string or a list of named templates),
rendered in a sandbox as Hugging Face renders it. A model without a tokenizer (tiny-llama) serves
token-id prompts only; its choices carry `token_ids` and empty text.

Encoding is called off the event loop (the server runs it in a thread; `encode_batch` releases the
GIL), after `fits` has refused text too long to fit the context without tokenizing it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from neuron_async_sm.model import tokenizer_path


class ChatTemplateError(ValueError):
    """The model has no chat template, or rendering it failed; the message says which."""


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str
    eos_token: str

    def render(self, messages: list[dict[str, str]], *, add_generation_prompt: bool) -> str:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ChatTemplateError(f"messages: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.source).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as exc:
            raise ChatTemplateError(f"messages: the model's chat template failed: {exc}") from exc


class ServedTokenizer:
    """Encode prompts, render chats, decode outputs. `None` in place of one means: token ids only."""

    def __init__(self, model: str) -> None:
        from tokenizers import Tokenizer

        path = tokenizer_path(model)
        if path is None:
            raise FileNotFoundError(f"{model}: no tokenizer.json")
        self.tokenizer = Tokenizer.from_file(path)
        directory = Path(path).parent
        self.config = _read_config(directory / "tokenizer_config.json")
        self.chat_template = _chat_template(directory, self.config)
        # No token covers more characters than the vocabulary's longest entry (byte-level and
        # SentencePiece entries spell each byte as one character): `may_fit` bounds a text's tokens
        # from its length alone.
        self.max_token_chars = max((len(t) for t in self.tokenizer.get_vocab()), default=1)

    @classmethod
    def load(cls, model: str) -> ServedTokenizer | None:
        return cls(model) if tokenizer_path(model) is not None else None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works; encode holds it longer (measured on a 10 MB text).
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def may_fit(self, num_chars: int, max_tokens: int) -> bool:
        """False when text of `num_chars` characters surely has more than `max_tokens` tokens.

        Twice the bound, as a margin for normalizers and pre-tokenizers that drop characters
        (whitespace splitting): refusing a prompt that would have fit is the one mistake not to make.
        """
        return num_chars <= 2 * max_tokens * self.max_token_chars

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_strs(self, token_ids: list[int]) -> list[str]:
        return [self.tokenizer.id_to_token(t) or "" for t in token_ids]

    def info(self) -> dict:
        """vLLM's /tokenizer_info: the tokenizer config, its special tokens and the chat template in use."""
        info = {k: v for k, v in self.config.items() if k != "added_tokens_decoder"}
        info["bos_token"] = _token_text(self.config.get("bos_token")) or None
        info["eos_token"] = _token_text(self.config.get("eos_token")) or None
        info["chat_template"] = self.chat_template.source if self.chat_template is not None else None
        return info

    def encode_chat(
        self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True, add_special_tokens: bool = False
    ) -> list[int]:
        """The template writes the special tokens itself (`add_special_tokens=False`, as vLLM's chat does)."""
        if self.chat_template is None:
            raise ChatTemplateError(
                "messages: this model has no chat template (no chat_template.jinja, no chat_template in "
                "tokenizer_config.json); use /v1/completions"
            )
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=add_special_tokens)


def _read_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return config if isinstance(config, dict) else {}


def _chat_template(directory: Path, config: dict) -> ChatTemplate | None:
    try:
        source: object = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    except OSError:
        source = config.get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default") or next(iter(named.values()), None)
    if not isinstance(source, str):
        return None
    return ChatTemplate(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))


def _token_text(token: object) -> str:
    if isinstance(token, dict):  # older configs: {"content": "<s>", ...}
        token = token.get("content")
    return token if isinstance(token, str) else ""


class IncrementalText:
    """Decode a request's tokens as they stream, and find its stop strings.

    Text is re-decoded from all tokens each time (a token may complete a multi-byte character or
    change how the previous one decodes); what was already sent is never sent again. While stop
    strings are set, the last `len(longest stop) - 1` characters are held back, so a stop string
    split over two steps is never partly sent; an unfinished character (U+FFFD) is held back too.
    """

    def __init__(
        self,
        tokenizer: ServedTokenizer | None,
        stop: tuple[str, ...],
        *,
        skip_special_tokens: bool = True,
        include_stop: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop  # the text ends with the stop string that matched (vLLM's option)
        # vLLM's min_tokens: a stop string counts only once it ends past the first min_tokens tokens' text.
        self.min_tokens = min_tokens
        self._floor: int | None = 0 if min_tokens == 0 else None  # that text's length, once known
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # decoded so far (cut at a stop string once one matched)
        self.sent = 0  # characters of `text` already handed out
        self.stopped = False  # a stop string matched: the request must end now

    def push(self, new_token_ids: list[int], *, final: bool = False) -> str:
        """Add a step's tokens; return the text that may be sent now (all of it when `final`)."""
        if self.stopped:
            return ""
        self.token_ids.extend(new_token_ids)
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        if self._floor is None and len(self.token_ids) > self.min_tokens:
            head = self.token_ids[: self.min_tokens]
            self._floor = len(self.tokenizer.decode(head, skip_special_tokens=self.skip_special_tokens))
        cut = None if self._floor is None else self._first_stop(text, self._floor)
        if cut is not None:
            self.stopped, final = True, True
            text = text[: cut[1] if self.include_stop else cut[0]]
        self.text = text
        end = len(text)
        if not final:
            end -= self._holdback
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.sent:
            return ""
        piece, self.sent = text[self.sent : end], end
        return piece

    def _first_stop(self, text: str, floor: int) -> tuple[int, int] | None:
        """(start, end) of the first stop string in `text`; the longest of those starting there."""
        # Only where a match can be new: one that ended inside the sent text would have stopped us
        # (or one that ends within the first min_tokens tokens' text, `floor`, which does not count).
        start = max(0, self.sent - self._holdback)
        hits = [(i, i + len(s)) for s in self.stop if (i := text.find(s, max(start, floor - len(s) + 1))) >= 0]
        return min(hits, key=lambda hit: (hit[0], -hit[1])) if hits else None
