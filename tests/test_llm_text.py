"""`LLM.generate` takes text as vLLM's does: one string is one prompt (not a list of characters), encoded
with the model directory's tokenizer.json; a list mixes texts and token ids."""

from __future__ import annotations

import pytest
from support.serve_harness import write_text_model
from tokenizers import Tokenizer

from neuron_async_sm import LLM, InvalidRequestError, SamplingParams

GREEDY = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(write_text_model(tmp_path_factory.mktemp("model")))


def test_a_string_is_one_prompt_encoded_by_the_models_tokenizer(model):
    tokenizer = Tokenizer.from_file(f"{model}/tokenizer.json")
    text = "w5 w9 w17"
    with LLM(model, device="cpu-inprocess", max_model_len=64) as llm:
        [from_text] = llm.generate(text, GREEDY)
        [from_ids] = llm.generate([tokenizer.encode(text).ids], GREEDY)
        mixed = llm.generate([text, [5, 6]], GREEDY)
    assert from_text.prompt_token_ids == tokenizer.encode(text).ids
    assert from_text.output_token_ids == from_ids.output_token_ids and from_text.finish_reason == "length"
    assert [o.prompt_token_ids for o in mixed] == [tokenizer.encode(text).ids, [5, 6]]


def test_text_without_a_tokenizer_is_refused_by_name():
    with LLM("tiny-llama", device="cpu-inprocess", max_model_len=64) as llm:
        with pytest.raises(InvalidRequestError, match="^prompt: text prompts need a tokenizer.json"):
            llm.generate("w5 w6", GREEDY)
