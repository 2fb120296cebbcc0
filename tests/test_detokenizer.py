"""The server's output text reads as vLLM's: decoded in the prompt's context, stop strings found as
vLLM finds them, logprobs' token texts as vLLM's engine writes them. Three real tokenizer.json kinds:
SentencePiece-style (Metaspace, byte fallback, the decoder that strips the text's first space), byte-level
BPE, and a whitespace word-level vocabulary. The reference is the tokenizer decoding the whole sequence at
once (prompt and output, minus the prompt's text); tests/under_vllm/test_vllm_detokenizer.py compares
the same code with vLLM's own detokenizer.
"""

from __future__ import annotations

import random

import pytest
from support.grammar_model import write_json_model
from support.sentencepiece_model import write_sentencepiece_model
from support.serve_harness import write_text_model

from neuron_async_sm.serve.detokenizer import IncrementalText
from neuron_async_sm.serve.tokenizer import ServedTokenizer

KINDS = {"sentencepiece": write_sentencepiece_model, "byte-level": write_json_model, "words": write_text_model}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, ServedTokenizer]:
    folder = tmp_path_factory.mktemp("tokenizers")
    return {kind: ServedTokenizer(str(write(folder / kind))) for kind, write in KINDS.items()}


@pytest.fixture(scope="module")
def spm(tokenizers) -> ServedTokenizer:
    return tokenizers["sentencepiece"]


@pytest.fixture(scope="module")
def words(tokenizers) -> ServedTokenizer:
    return tokenizers["words"]


def PROMPT(words: ServedTokenizer) -> list[int]:  # noqa: N802
    return [1, *ids(words, "w20")]  # bos (special: no text), then a word: the output's text follows a space


def ids(tokenizer: ServedTokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def text_of(tokenizer: ServedTokenizer, token_id: int) -> bool:
    """The token decodes to text by itself: not special, not a piece of a multi-byte character."""
    text = tokenizer.decode([token_id])
    return bool(text) and "\ufffd" not in text


def in_context(tokenizer: ServedTokenizer, prompt: list[int], output: list[int]) -> str:
    """The reference: the whole sequence decoded at once, minus the prompt's text."""
    whole, head = tokenizer.decode(prompt + output), tokenizer.decode(prompt)
    assert whole.startswith(head), (whole, head)
    return whole[len(head) :]


def streamed(text: IncrementalText, output: list[int], rng: random.Random, finish_reason: str = "length") -> str:
    """Push `output` in random steps of 1-3 tokens, the last with `finish_reason`; all text sent."""
    sent, i = [], 0
    while i < len(output):
        j = min(len(output), i + rng.randint(1, 3))
        sent.append(text.push(output[i:j], finish_reason if j == len(output) else None))
        i = j
    return "".join(sent)


def test_a_sentencepiece_outputs_first_word_keeps_its_space_after_the_prompt(spm):
    prompt, output = ids(spm, "the cat"), ids(spm, " sat on the mat")
    assert spm.tokenizer.id_to_token(output[0]) == "\u2581sat"
    assert spm.decode(output) == "sat on the mat"  # alone, the decoder strips the first space
    text = IncrementalText(spm, (), prompt_ids=prompt)
    assert [text.push([t]) for t in output] == [" sat", " on", " the", " mat"]


def test_streamed_text_equals_the_whole_sequence_decoded_at_once(tokenizers):
    """Random prompts and outputs of tokens that are text by themselves (no piece of a character),
    pushed in random steps, for each tokenizer kind."""
    rng = random.Random(0)
    for kind, tokenizer in tokenizers.items():
        vocab = [i for i in range(3, tokenizer.tokenizer.get_vocab_size()) if text_of(tokenizer, i)]
        for _ in range(40):
            prompt = [1, *rng.choices(vocab, k=rng.randint(1, 6))]  # bos first, as encode() puts it
            output = rng.choices(vocab, k=rng.randint(1, 10))
            text = IncrementalText(tokenizer, (), prompt_ids=prompt)
            assert streamed(text, output, rng) == in_context(tokenizer, prompt, output), (kind, prompt, output)


@pytest.mark.parametrize("kind", ["sentencepiece", "byte-level"])
def test_a_character_split_over_tokens_is_sent_once_complete(tokenizers, kind):
    tokenizer = tokenizers[kind]
    output = ids(tokenizer, " café’s")
    split = output[-4:-1]  # the 3 bytes of "’" (then "s")
    assert all(tokenizer.decode([t]).endswith("\ufffd") for t in split)
    text = IncrementalText(tokenizer, (), prompt_ids=ids(tokenizer, "the cat"))
    pieces = [text.push([t]) for t in output]
    assert "".join(pieces) == in_context(tokenizer, ids(tokenizer, "the cat"), output)
    assert "\ufffd" not in "".join(pieces) and "’" in pieces


def test_echo_of_a_word_level_prompt_reads_as_one_text(words):
    """`w24` then `w29`: " w29" after the prompt (vLLM's `w24 w29`), not "w29" (`w24w29`)."""
    text = IncrementalText(words, (), prompt_ids=ids(words, "w24"))
    assert words.decode(ids(words, "w24")) + text.push(ids(words, "w29"), "length") == "w24 w29"


def test_a_stop_string_split_over_two_steps_is_never_partly_sent(words):
    text = IncrementalText(words, ("9 w1",), prompt_ids=ids(words, "w5"))
    sent = [text.push(ids(words, "w8")), text.push(ids(words, "w9"))]  # " w8 w9": its last 3 may start it
    assert "".join(sent) == " w8" and not text.stopped
    assert text.push(ids(words, "w10 w11")) == " w" and text.stopped  # " w8 w9 w10" has "9 w1": cut before it
    assert text.text == " w8 w" and text.token_ids == ids(words, "w8 w9 w10")  # w11 came after it: dropped
    assert text.push(ids(words, "w12")) == ""


def test_the_stop_string_that_completes_first_wins_as_vllms(words):
    """vLLM's rule: the one ending first (ties: the first listed), not the one starting first."""
    text = IncrementalText(words, ("w5 w6 w7", "w6"), prompt_ids=PROMPT(words), include_stop=True)
    assert text.push(ids(words, "w5 w6 w7"), None) == " w5 w6" and text.stopped
    assert text.token_ids == ids(words, "w5 w6")
    text = IncrementalText(words, ("w6", "6"), prompt_ids=PROMPT(words))
    text.push(ids(words, "w5 w6"))
    assert text.stopped and text.text == " w5 "  # both end at once: "w6", listed first


def test_a_stop_string_may_begin_with_the_space_the_prompt_gives_the_output(spm):
    """Only the output's text is searched; its first word's space is in it: " sat" stops at once."""
    text = IncrementalText(spm, (" sat",), prompt_ids=ids(spm, "the cat"))
    assert text.push(ids(spm, " sat on"), None) == "" and text.stopped and text.token_ids == ids(spm, " sat")


def test_a_stop_string_within_the_first_min_tokens_tokens_does_not_stop(words):
    """vLLM's min_tokens holds back stop strings too: one that ends within the first min_tokens
    tokens' text is output; the next one stops."""
    eager = IncrementalText(words, ("w7",), prompt_ids=PROMPT(words))
    eager.push(ids(words, "w7"))
    assert eager.stopped
    text = IncrementalText(words, ("w7",), prompt_ids=PROMPT(words), min_tokens=2)
    text.push(ids(words, "w7"))
    text.push(ids(words, "w5"))
    assert not text.stopped
    text.push(ids(words, "w7"), "length")
    assert text.stopped and text.text == " w7 w5 "


def test_without_stop_strings_text_streams_at_once_and_held_text_comes_on_the_last_piece(words):
    text = IncrementalText(words, (), prompt_ids=PROMPT(words))
    assert text.push(ids(words, "w3")) == " w3" and text.push(ids(words, "w4"), "length") == " w4"
    held = IncrementalText(words, ("w4 w4",), prompt_ids=PROMPT(words))
    assert held.push(ids(words, "w3")) == "" and held.push(ids(words, "w4"), "length") == " w3 w4"
    assert not held.stopped
    included = IncrementalText(words, ("w4 w4",), prompt_ids=PROMPT(words), include_stop=True)
    assert included.push(ids(words, "w3")) == " w3"  # nothing is cut, so nothing is held back


def test_the_engines_stop_token_is_not_decoded_unless_include_stop(words):
    """A request the engine ended on a stop token (eos, stop_token_ids: finish reason "stop")."""
    for include, want in ((False, " w3"), (True, " w3 w9")):
        text = IncrementalText(words, (), prompt_ids=PROMPT(words), include_stop=include)
        assert text.push(ids(words, "w3 w9"), "stop") == want and text.token_ids == ids(words, "w3 w9")


def test_special_tokens_are_skipped_or_spaced_as_asked(words):
    """Two special tokens in a row are joined without a space when spaces_between_special_tokens is off."""
    eos = words.tokenizer.token_to_id("</s>")
    output = [*ids(words, "w3"), eos, eos]
    options = {"skip": {}, "spaced": {"skip_special_tokens": False}}
    options["joined"] = {"skip_special_tokens": False, "spaces_between_special_tokens": False}
    got = {
        k: IncrementalText(words, (), prompt_ids=PROMPT(words), **o).push(output, "length") for k, o in options.items()
    }
    assert got == {"skip": " w3", "spaced": " w3 </s> </s>", "joined": " w3 </s></s>"}


def test_logprob_token_texts_keep_the_sentencepiece_space_and_complete_split_characters(spm):
    """vLLM's engine: decode([id]) with the "▁" it strips put back as a space; a piece of a split
    character completed from the tokens sampled before it, or "" until it is complete."""
    [sat] = ids(spm, " sat")
    assert spm.decode([sat]) == "sat" and spm.token_text(sat, []) == " sat"
    *_, b1, b2, b3 = ids(spm, " café’")  # "’" is three byte pieces
    assert [spm.token_text(b1, []), spm.token_text(b2, [b1]), spm.token_text(b3, [b1, b2])] == ["", "", "’"]


def test_a_config_special_token_missing_from_tokenizer_json_is_special(words):
    """The word-level tokenizer.json lists <s> as a word; its config names it bos: transformers (and so
    vLLM) makes it special, so decoding skips it."""
    assert words.decode(ids(words, "<s> w3")) == "w3"
