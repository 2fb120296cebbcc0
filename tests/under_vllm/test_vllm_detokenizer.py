"""Our server's text is vLLM's, compared with vLLM's own code in-process (no engine started): its
detokenizer (v1 `IncrementalDetokenizer`, which `vllm serve` runs per request) and its logprobs' token
texts (`convert_ids_list_to_tokens` then `LogprobsProcessor._verify_tokens`), on vLLM's own tokenizer
(`vllm.tokenizers.get_tokenizer`) of three real tokenizer.json kinds: SentencePiece-style, byte-level
BPE, word-level. Random prompts, outputs of any tokens (pieces of characters, special tokens), steps of
1-3 tokens, stop strings cut from the text, min_tokens, include_stop_str_in_output,
skip_special_tokens, spaces_between_special_tokens, and requests the engine ends on a stop token.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from support.grammar_model import write_json_model
from support.sentencepiece_model import write_sentencepiece_model
from support.serve_harness import write_text_model
from support.vllm_harness import needs_vllm

from neuron_async_sm.serve.detokenizer import IncrementalText
from neuron_async_sm.serve.tokenizer import ServedTokenizer

pytestmark = needs_vllm

KINDS = {"sentencepiece": write_sentencepiece_model, "byte-level": write_json_model, "words": write_text_model}
TRIALS = 200


@pytest.fixture(scope="module", params=list(KINDS))
def tokenizers(request, tmp_path_factory) -> tuple[object, ServedTokenizer]:
    """(vLLM's tokenizer, ours) of one checkpoint."""
    from vllm.tokenizers import get_tokenizer

    path = str(KINDS[request.param](tmp_path_factory.mktemp(request.param)))
    return get_tokenizer(path), ServedTokenizer(path)


def test_streamed_text_stop_strings_and_kept_tokens_equal_vllms_detokenizer(tokenizers):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    theirs_tokenizer, ours_tokenizer = tokenizers
    vocab = len(ours_tokenizer.tokenizer.get_vocab())
    rng = random.Random(1)
    stopped = 0
    for _ in range(TRIALS):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        whole = theirs_tokenizer.decode(prompt + output)
        at, length = rng.randrange(max(1, len(whole) - 1)), rng.randint(1, 3)
        stop = [whole[at : at + length]] if rng.random() < 0.5 and whole[at : at + length] else []
        options = dict(
            skip_special_tokens=rng.random() < 0.7,
            spaces_between_special_tokens=rng.random() < 0.5,
            include_stop_str_in_output=rng.random() < 0.3,
            min_tokens=rng.choice([0, 0, 2]),
        )
        params = SamplingParams(stop=stop or None, max_tokens=64, **options)
        request = SimpleNamespace(sampling_params=params, prompt_token_ids=prompt, request_id="r", prompt_embeds=None)
        theirs = IncrementalDetokenizer.from_new_request(theirs_tokenizer, request)  # type: ignore[arg-type]
        ours = IncrementalText(
            ours_tokenizer,
            tuple(stop),
            prompt_ids=prompt,
            skip_special_tokens=options["skip_special_tokens"],
            spaces_between_special_tokens=options["spaces_between_special_tokens"],
            include_stop=options["include_stop_str_in_output"],
            min_tokens=options["min_tokens"],
        )
        last_reason = rng.choice(["stop", "length"])  # "stop": the engine's stop token ended it
        sent_theirs, sent_ours, i = [], [], 0
        while i < len(output):
            j = min(len(output), i + rng.randint(1, 3))
            reason = last_reason if j == len(output) else None
            matched = theirs.update(output[i:j], reason == "stop")
            finished = reason is not None or matched is not None
            sent_theirs.append(theirs.get_next_output_text(finished, True))
            sent_ours.append(ours.push(output[i:j], reason))
            assert ours.stopped == (matched is not None)
            if finished:
                break
            i = j
        case = (prompt, output, stop, options, last_reason)
        assert sent_ours == sent_theirs, case
        assert ours.token_ids == theirs.output_token_ids, case
        stopped += ours.stopped
    assert stopped >= TRIALS // 10  # the stop-string paths ran


def test_logprobs_token_texts_equal_vllms_engine(tokenizers):
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens
    from vllm.v1.engine.logprobs import LogprobsProcessor

    theirs_tokenizer, ours_tokenizer = tokenizers
    processor = LogprobsProcessor(
        tokenizer=theirs_tokenizer,
        logprobs=[],
        prompt_logprobs=None,
        cumulative_logprob=0.0,
        num_logprobs=3,
        num_prompt_logprobs=None,
    )
    vocab = len(ours_tokenizer.tokenizer.get_vocab())
    rng = random.Random(2)
    for _ in range(5 * TRIALS):
        context = [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]
        candidates = [rng.randrange(vocab) for _ in range(3)]  # one position's: sampled, then the top ones
        decoded = convert_ids_list_to_tokens(theirs_tokenizer, candidates)
        theirs = processor._verify_tokens(decoded, candidates, context)
        assert [ours_tokenizer.token_text(t, context) for t in candidates] == theirs, (context, candidates)
