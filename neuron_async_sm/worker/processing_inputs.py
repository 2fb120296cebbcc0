"""The logits-processing inputs of a step (`model/logits_processors.py`), built on the host from the
rows' sampling parameters."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from neuron_async_sm.model.logits_processors import PROCESSING_INPUTS
from neuron_async_sm.sampling_params import SamplingParams

_NUMPY = {torch.int32: np.int32, torch.float32: np.float32}


def _width(longest: int) -> int:
    """A list input's width: the next power of two (a compiling device builds one program per width)."""
    return 1 << max(longest - 1, 0).bit_length()


def processing_inputs(
    params: Sequence[SamplingParams],
    prompt_len: np.ndarray,
    num_padded: int,
    eos_token_ids: Sequence[int],
    *,
    always: bool = False,
) -> dict[str, np.ndarray]:
    """The step's processing inputs for rows with `params` (padded to `num_padded` rows), or none when
    no row processes its logits (the program then skips processing and the history) unless `always`
    (every row's neutral values then)."""
    if not always and not any(p.processes_logits for p in params):
        return {}
    stops = [(*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)) if p.min_tokens > 0 else () for p in params]
    lists = {
        "stop_ids": stops,
        "bias_ids": [[token for token, _ in p.logit_bias] for p in params],
        "bias_values": [[bias for _, bias in p.logit_bias] for p in params],
        "allowed_ids": [p.allowed_token_ids or () for p in params],
        "bad_ids": [[token for word in p.bad_words_token_ids for token in word] for p in params],
        "bad_word": [[k for k, word in enumerate(p.bad_words_token_ids) for _ in word] for p in params],
        "bad_back": [[len(word) - 1 - j for word in p.bad_words_token_ids for j in range(len(word))] for p in params],
    }
    out = {}
    for spec in PROCESSING_INPUTS:
        dtype = _NUMPY[spec.dtype]
        if spec.listed:
            values = lists[spec.name]
            array = np.full((num_padded, _width(max(map(len, values)))), spec.pad, dtype=dtype)  # [B, W]
            for row, items in enumerate(values):
                array[row, : len(items)] = items
        else:
            array = np.full(num_padded, spec.pad, dtype=dtype)  # [B]
            array[: len(params)] = prompt_len if spec.name == "prompt_len" else [getattr(p, spec.name) for p in params]
        out[spec.name] = array
    return out
