"""One step's logprobs on the host side: the program inputs that ask for them, and reading them back.

A step computes logprobs only when one of its rows asks (`SamplingParams.logprobs` /
`prompt_logprobs`): every other step runs the program exactly as before and its output is the tokens
alone. Computed on the device (model/logprobs.py), they come back packed in the step's one output, so
the output thread reads them in the same transfer and the same call-once materialization as the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from neuron_async_sm.model.logprobs import LogprobsLayout
from neuron_async_sm.outputs import TokenLogprobs
from neuron_async_sm.runtime import WireTensor

NONE = -1  # a row's count when it does not ask


def top_count(counts: np.ndarray) -> int:
    """The step's top-N: the most any row asks for (NONE when no row asks)."""
    return int(counts.max()) if counts.size else NONE


def count_input(count: int) -> WireTensor:
    """A count as the program takes it: int32 `[1]`, a host value (read on the host, no device sync)."""
    return WireTensor.encode(torch.tensor([count], dtype=torch.int32))


@dataclass(frozen=True)
class StepLogprobs:
    """Which rows of one step asked for which logprobs, and how its packed output holds them."""

    layout: LogprobsLayout
    sample_counts: np.ndarray  # int [R]: top tokens per sampled token each row asked for; NONE: none
    prompt_counts: np.ndarray  # int [R]: top tokens per prompt position; NONE: none
    prompt_targets: np.ndarray | None  # int32 [R, L]: the prompt token after each position of the chunk
    prompt_valid: np.ndarray | None  # bool [R, L]: the positions whose next token is a prompt token (asked)

    def read(
        self, output: torch.Tensor, sample_positions: tuple[int | None, ...]
    ) -> tuple[list[int], list[TokenLogprobs | None], list[list[TokenLogprobs] | None] | None]:
        """The host copy of the packed output `[B, 1 + width]` as (tokens `[R]`, per row the sampled
        token's logprobs, per row its chunk's prompt logprobs; None where the step computed none)."""
        columns, sample, prompt = self.layout.split(output)
        tokens = columns[: len(sample_positions), 0].tolist()
        runs = self._sampled(sample, [[t] for t in tokens], sample_positions)
        logprobs = [None if run is None else run[0] for run in runs]
        return tokens, logprobs, self._prompt(prompt, len(sample_positions))

    def read_runs(
        self, output: torch.Tensor, token_columns: int, runs: list[list[int]], sample_positions: tuple[int | None, ...]
    ) -> tuple[list[list[TokenLogprobs] | None], list[list[TokenLogprobs] | None] | None]:
        """A speculative step's: the host copy `[B, token_columns + width]` (its token columns first) and
        each row's run (accepted drafts, then one more) as (per row one TokenLogprobs per token of its
        run, per row its chunk's prompt logprobs; None where the step computed none)."""
        _, sample, prompt = self.layout.split(output, token_columns)
        return self._sampled(sample, runs, sample_positions), self._prompt(prompt, len(sample_positions))

    def _sampled(
        self, sample: np.ndarray, runs: list[list[int]], sample_positions: tuple[int | None, ...]
    ) -> list[list[TokenLogprobs] | None]:
        """Per row, the logprobs of each token its run emitted (block j: the run's token j)."""
        found: list[list[TokenLogprobs] | None] = [None] * len(sample_positions)
        if self.layout.sample_top < 0:
            return found
        width = self.layout.sample_top
        for row in np.flatnonzero(self.sample_counts >= 0).tolist():
            if sample_positions[row] is not None:  # a partial prefill chunk samples nothing
                count = int(self.sample_counts[row])
                found[row] = [_position(token, sample[row, j], width, count) for j, token in enumerate(runs[row])]
        return found

    def _prompt(self, prompt: np.ndarray, num_rows: int) -> list[list[TokenLogprobs] | None] | None:
        if self.prompt_valid is None or self.prompt_targets is None:
            return None
        width = self.layout.prompt_top
        prompt_logprobs: list[list[TokenLogprobs] | None] = [None] * num_rows
        for row in np.flatnonzero(self.prompt_counts >= 0).tolist():
            count, targets = int(self.prompt_counts[row]), self.prompt_targets[row]
            prompt_logprobs[row] = [
                _position(int(targets[j]), prompt[row, j], width, count)
                for j in np.flatnonzero(self.prompt_valid[row]).tolist()
            ]
        return prompt_logprobs


def _position(token: int, block: np.ndarray, width: int, count: int) -> TokenLogprobs:
    """One position's block (`[logprob, rank, width ids, width logprobs]`, float32), its first
    `count` top tokens."""
    values = block.tolist()
    return TokenLogprobs(
        token_id=token,
        logprob=values[0],
        rank=int(values[1]),
        top_ids=tuple(int(v) for v in values[2 : 2 + count]),
        top_logprobs=tuple(values[2 + width : 2 + width + count]),
    )
