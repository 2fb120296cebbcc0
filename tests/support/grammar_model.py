"""A random Llama checkpoint whose tokenizer can spell JSON: a byte-level BPE trained in the test
(the project's text model has a 64-word vocabulary with no `{`, `"` or digits), and the constrained
workload the structured-output tests run: bounded schemas, regexes, choices and a Lark grammar whose
every output ends well within max_tokens, each with the check its outputs must pass. Test-side only.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

import jsonschema

from neuron_async_sm.bench.checkpoint import write_checkpoint
from neuron_async_sm.bench.workloads import BENCH_CONSTRAINTS
from neuron_async_sm.structured_output import StructuredOutputsParams

SPECIAL = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: the checkpoint's bos 1 and eos 2
VOCAB_SIZE = 320  # the model's; the tokenizer has a few fewer (the bitmask covers the model's)
MAX_TOKENS = 120  # every workload output ends within this many tokens
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

# The bench's bounded constraints (`bench --constrained-fraction`), and two more of the tests' own.
PERSON, REGEX, CHOICES = (c.json or c.regex or c.choice for c in BENCH_CONSTRAINTS)
FLAGS = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "tag"],
    "additionalProperties": False,
}
LARK = 'start: "(" NUM ("+" NUM)? ")"\nNUM: /[0-9]{1,2}/'
LARK_MATCH = r"\([0-9]{1,2}(\+[0-9]{1,2})?\)"


def _corpus(rng: random.Random) -> list[str]:
    words = ["name", "age", "ok", "tag", "red", "green", "blue", "yes", "no", "maybe", "true", "false"]
    lines = []
    for _ in range(300):
        lines.append(
            json.dumps({"name": "".join(rng.choices("abcdefxyz", k=rng.randint(0, 6))), "age": rng.randint(0, 99)})
        )
        lines.append(
            " ".join(rng.choices(words, k=6)) + f" ({rng.randint(0, 99)}+{rng.randint(0, 99)}) ab-{rng.randint(0, 999)}"
        )
    return lines


def write_llama(path: Path, tokenizer: object, vocab_size: int, **fields: object) -> Path:
    """A random `vocab_size`-token Llama checkpoint with `tokenizer` (a tokenizers.Tokenizer) and a
    tokenizer_config.json naming its bos <s> (id 1), eos </s> (id 2) and chat template."""
    path.mkdir(parents=True, exist_ok=True)
    write_checkpoint(
        path,
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": vocab_size,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 256,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "tie_word_embeddings": False,
            **fields,
        },
    )
    tokenizer.save(str(path / "tokenizer.json"))  # type: ignore[attr-defined]
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def write_json_model(path: Path, **fields: object) -> Path:
    """A random VOCAB_SIZE-token Llama checkpoint with a byte-level BPE tokenizer.json trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 8, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(_corpus(random.Random(0)), trainer)
    return write_llama(path, tokenizer, VOCAB_SIZE, **fields)


@dataclass(frozen=True)
class Constraint:
    """One constrained request's structured_outputs and the check every output of it must pass."""

    params: StructuredOutputsParams

    def check(self, text: str) -> None:
        """Raises (AssertionError / jsonschema.ValidationError / ValueError) unless `text` satisfies it."""
        p = self.params
        if p.json is not None:
            jsonschema.validate(json.loads(text), p.json)
        elif p.regex is not None:
            assert re.fullmatch(p.regex, text), (p.regex, text)
        elif p.choice is not None:
            assert text in p.choice, (p.choice, text)
        else:
            assert re.fullmatch(LARK_MATCH, text), (p.grammar, text)


CONSTRAINTS = (
    Constraint(StructuredOutputsParams(json=PERSON)),
    Constraint(StructuredOutputsParams(regex=REGEX)),
    Constraint(StructuredOutputsParams(choice=CHOICES)),
    Constraint(StructuredOutputsParams(json=FLAGS)),
    Constraint(StructuredOutputsParams(grammar=LARK)),
)
