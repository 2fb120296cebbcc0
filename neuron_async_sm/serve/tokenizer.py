"""Text for the server: the model directory's `tokenizer.json`, its chat template, and one token's text
(logprobs). An output's text streams from `detokenizer.py`.

The tokenizer is loaded as transformers loads it for vLLM: the special tokens tokenizer_config.json
names are special, whether or not tokenizer.json lists them.

The chat template is `chat_template.jinja` beside `tokenizer_config.json` (where current
transformers saves it), else the config's `chat_template` (a string or a list of named templates),
rendered in a sandbox as Hugging Face renders it. A model without a tokenizer (tiny-llama) serves
token-id prompts only; its choices carry `token_ids` and empty text.

Encoding is called off the event loop (the server runs it in a thread; `encode_batch` releases the
GIL), after `fits` has refused text too long to fit the context without tokenizing it.
"""

from __future__ import annotations

import json
import os
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
        from tokenizers import AddedToken, Tokenizer

        path = tokenizer_path(model)
        if path is None:
            raise FileNotFoundError(f"{model}: no tokenizer.json")
        self.tokenizer = Tokenizer.from_file(path)
        directory = Path(path).parent
        self.config = _read_config(directory / "tokenizer_config.json")
        # As transformers loads it (and so vLLM): the config's named special tokens become special added
        # tokens, which decoding with skip_special_tokens drops even where tokenizer.json does not list them.
        self.tokenizer.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in _special_tokens(self.config)]
        )
        self.chat_template = _chat_template(directory, self.config)
        # No token covers more characters than the vocabulary's longest entry (byte-level and
        # SentencePiece entries spell each byte as one character): `may_fit` bounds a text's tokens
        # from its length alone.
        self.max_token_chars = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        self.added_tokens = {i: t.content for i, t in self.tokenizer.get_added_tokens_decoder().items()}
        self.space_marker = _space_marker(json.loads(self.tokenizer.to_str()).get("pre_tokenizer"))

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

    def token_text(self, token_id: int, context: list[int]) -> str:
        """One token's text in logprobs, as vLLM's engine writes it (detokenizer_utils'
        convert_ids_list_to_tokens, LogprobsProcessor._verify_tokens): `decode([id])` with special
        tokens kept; a Metaspace tokenizer's leading "▁"s, which decode strips, as spaces; a token
        ending inside a multi-byte character (U+FFFD) completed from `context`, the sampled tokens
        before it (the last 4 at most), or "" when they do not complete it."""
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if self.space_marker is not None:
            raw = self.tokenizer.id_to_token(token_id) or ""
            markers = len(raw) - len(raw.lstrip(self.space_marker))
            missing = markers - (len(text) - len(text.lstrip(" ")))
            text = " " * missing + text if missing > 0 else text
        return self._completed(token_id, context[-4:]) if text.endswith("\ufffd") else text

    def _completed(self, token_id: int, context: list[int]) -> str:
        """vLLM's _correct_decoded_token: the text `token_id` completes after the fewest of `context`'s
        last tokens that end its character, without the text of those that did not need it."""
        decode = self.tokenizer.decode
        for n in range(1, len(context) + 1):
            before = context[-n:]
            whole = decode([*before, token_id], skip_special_tokens=False)
            if whole.endswith("\ufffd"):
                continue
            clean = len(before)  # the context tokens before the unfinished ones (their text stays theirs)
            while clean > 0 and decode([before[clean - 1]], skip_special_tokens=False).endswith("\ufffd"):
                clean -= 1
            prefix = decode(before[:clean], skip_special_tokens=False) if clean else ""
            # Past their common prefix (all of `prefix`, unless a normalizer changed it).
            return whole[len(os.path.commonprefix([prefix, whole])) :]
        return ""

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


SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _special_tokens(config: dict) -> list[str]:
    """The special tokens a tokenizer_config.json names (transformers' attributes and extra lists)."""
    named = [config.get(key) for key in SPECIAL_TOKEN_KEYS]
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = config.get(key)
        named += extra if isinstance(extra, list) else []
    return [text for text in map(_token_text, named) if text]


def _space_marker(pre_tokenizer: dict | None) -> str | None:
    """The replacement character of a Metaspace pre-tokenizer (alone or in a Sequence), else None."""
    for pre in [pre_tokenizer or {}, *(pre_tokenizer or {}).get("pretokenizers", [])]:
        if pre.get("type") == "Metaspace":
            return pre.get("replacement", "\u2581")
    return None


def _token_text(token: object) -> str:
    if isinstance(token, dict):  # older configs: {"content": "<s>", ...}
        token = token.get("content")
    return token if isinstance(token, str) else ""
