"""lm-eval's `local-completions`, with its default settings, runs `generate_until` on our own task
(tests/clients/tasks/greedy_continuation.*) against `neuron-async-sm serve`: every answer equals greedy
`transformers` on the same checkpoint, cut where lm-eval cuts it.

Its defaults send token ids (`prompt=[[ids]]`, one prompt a request), tokenized by the server's own
/tokenize (found through /tokenizer_info) without special tokens, with the task's stop strings and
lm-eval's seed.
"""

from __future__ import annotations

import json

from support.clients_harness import TASKS, lm_eval_samples, needs
from support.reference import hf_greedy
from support.serve_harness import in_context

pytestmark = needs("lm_eval")

TASK = "nasm_greedy_continuation"
EOS_ID = 2  # the checkpoint's `</s>`: the server stops there, transformers' reference does not


def test_generate_until_answers_equal_greedy_transformers(server, hf_model, tokenizer, tmp_path):
    import yaml

    config = yaml.safe_load((TASKS / "greedy_continuation.yaml").read_text())
    until, max_gen_toks = config["generation_kwargs"]["until"], config["generation_kwargs"]["max_gen_toks"]
    docs = [json.loads(line) for line in (TASKS / "greedy_continuation.jsonl").read_text().splitlines()]

    samples = lm_eval_samples(server.url, server.model, TASK, tmp_path)

    expected = []
    for doc in docs:
        prompt = tokenizer.encode(doc["context"], add_special_tokens=False).ids
        ids = hf_greedy(hf_model, prompt, max_gen_toks)
        ids = ids[: ids.index(EOS_ID)] if EOS_ID in ids else ids
        text = in_context(tokenizer, prompt, ids)  # as vLLM's server writes it: decoded after the prompt
        for stop in until:  # what lm-eval keeps of a generation: the text before its first stop string
            text = text.split(stop)[0]
        expected.append(text)
    answers = [s["resps"][0][0] for s in samples]
    assert [s["doc"] for s in samples] == docs
    assert answers == expected
    # The stop string ended some answers early, and the others ran to max_gen_toks.
    stopped = [a for a in answers if len(a.split()) < max_gen_toks]
    assert stopped and len(stopped) < len(answers), answers
