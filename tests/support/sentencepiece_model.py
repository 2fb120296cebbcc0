"""A random Llama checkpoint with a SentencePiece-style tokenizer.json, as transformers converts
Llama's (`LlamaConverter`, legacy=False): a BPE over "▁"-prefixed words with byte fallback (<0x00> ..
<0xFF>, ids 3..258), a Metaspace pre-tokenizer (prepend "▁" to the first word), <s> before every text,
and the decoder that turns "▁" back into spaces and strips the text's first one. Decoded alone, an
output's first word loses its space ("▁the" -> "the"); after the prompt it keeps it (" the").
Test-side only.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from support.grammar_model import SPECIAL, write_llama

WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "café", "naïve", "x", "y", "z"]
PIECES = 160  # trained pieces after the specials and the byte tokens


def write_sentencepiece_model(path: Path, **fields: object) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: PLC0415

    # Train the pieces with the tokenizers trainer, then lay out the vocabulary as SentencePiece does.
    trainer_tokenizer = Tokenizer(models.BPE())
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    rng = random.Random(0)
    corpus = [" ".join(rng.choices(WORDS, k=8)) + rng.choice([".", ",", "!", ""]) for _ in range(400)]
    trainer_tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=PIECES, show_progress=False))
    trained = json.loads(trainer_tokenizer.to_str())["model"]
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    pieces = sorted(trained["vocab"], key=trained["vocab"].get)
    vocab = {token: i for i, token in enumerate([*SPECIAL, *bytes_, *pieces])}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.add_special_tokens(SPECIAL)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return write_llama(path, tokenizer, len(vocab), **fields)
