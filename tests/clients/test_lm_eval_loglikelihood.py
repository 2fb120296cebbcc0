"""lm-eval's `local-completions`, with its default settings, runs loglikelihood (multiple choice) on our
own task (tests/clients/tasks/multiple_choice.*) against `neuron-async-sm serve`: every choice's
loglikelihood equals the one `transformers` computes on the same checkpoint (float32, within 1e-4),
and lm-eval's greedy flag and its pick agree with it.

Its defaults send each (context, choice) as token ids (`prompt=[[ids]]`) with `echo`, `logprobs=1`,
`max_tokens=1`, tokenized by the server's own /tokenize without special tokens; it sums
`token_logprobs[ctxlen:-1]` of the answer.
"""

from __future__ import annotations

import json

from support.clients_harness import TASKS, lm_eval_samples, needs
from support.reference import hf_logprobs

pytestmark = needs("lm_eval")

TASK = "nasm_multiple_choice"
TOL = 1e-4


def test_multiple_choice_loglikelihoods_equal_transformers(server, hf_model, tokenizer, tmp_path):
    import yaml

    config = yaml.safe_load((TASKS / "multiple_choice.yaml").read_text())
    assert config["output_type"] == "multiple_choice"
    docs = [json.loads(line) for line in (TASKS / "multiple_choice.jsonl").read_text().splitlines()]

    samples = lm_eval_samples(server.url, server.model, TASK, tmp_path)

    assert [s["doc"] for s in samples] == docs
    picks, greedy_seen = [], set()
    for doc, sample in zip(docs, samples, strict=True):
        context = tokenizer.encode(doc["context"], add_special_tokens=False).ids
        expected = []
        for choice in doc["choices"]:
            # lm-eval's pair: the whole text encoded, the context's tokens cut off (target_delimiter " ").
            whole = tokenizer.encode(f"{doc['context']} {choice}", add_special_tokens=False).ids
            assert whole[: len(context)] == context
            ref = hf_logprobs(hf_model, whole)
            rows = range(len(context) - 1, len(whole) - 1)
            total = sum(ref[r, whole[r + 1]].item() for r in rows)
            greedy = all(int(ref[r].argmax()) == whole[r + 1] for r in rows)
            expected.append((total, greedy))
        ours = [(float(resp[0][0]), resp[0][1] in (True, "True")) for resp in sample["resps"]]
        assert len(ours) == len(expected)
        for (got, got_greedy), (want, want_greedy) in zip(ours, expected, strict=True):
            assert abs(got - want) <= TOL, (doc, got, want)
            assert got_greedy == want_greedy, doc
            greedy_seen.add(want_greedy)
        picks.append(max(range(len(ours)), key=lambda i: ours[i][0]))
        assert float(sample["acc"]) == float(picks[-1] == doc["label"])
    assert greedy_seen == {True, False}  # the task has greedy continuations and others
    print(f"\nlm-eval picks {picks}, labels {[d['label'] for d in docs]}")
