"""Our step outputs as vLLM's ModelRunnerOutput: sampled tokens, their logprobs, prompt logprobs.

vLLM's shapes (vllm/v1/outputs.py): a step's sampled-token logprobs are one `LogprobsLists` for all
its rows, `[num_reqs, max_num_logprobs + 1]` token ids and logprobs (column 0 the sampled token, then
the most likely first) and `[num_reqs]` ranks; a request takes the first `its count + 1` columns and
a row that did not ask is never read. A request's prompt logprobs are one `LogprobsTensors` of
`[prompt_len - 1, count + 1]`, returned once, with its first token: vLLM's engine core returns
nothing for a partial prefill, so the chunks' logprobs are kept here until the prompt is done.
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.v1.outputs import LogprobsLists, LogprobsTensors
from vllm.v1.outputs import ModelRunnerOutput as VllmModelRunnerOutput

from neuron_async_sm.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprobs


class PromptLogprobs:
    """Per request, its prompt's logprobs so far (the chunks run), until the prompt is done.

    Filled where outputs become vLLM's: in step order, on one thread (vLLM's output thread, or its
    engine thread), so a request's chunks arrive in order.
    """

    def __init__(self) -> None:
        self._chunks: dict[str, list[TokenLogprobs]] = {}

    def take(self, step: SchedulerOutput, output: ModelRunnerOutput) -> dict[str, LogprobsTensors]:
        """The whole prompt's logprobs of each request whose prompt this step finished."""
        for req_id in step.finished_req_ids:
            self._chunks.pop(req_id, None)  # left mid-prompt (aborted, preempted)
        for new in step.scheduled_new_reqs:
            self._chunks.pop(new.request_id, None)  # (re)started: its prompt runs from position 0
        done: dict[str, LogprobsTensors] = {}
        if output.prompt_logprobs is None:
            return done
        for req_id, chunk in zip(output.req_ids, output.prompt_logprobs, strict=True):
            if chunk:  # None or empty: the row did not ask, or its chunk has no next prompt token
                self._chunks.setdefault(req_id, []).extend(chunk)
            if req_id in step.sampling_req_ids and req_id in self._chunks:
                done[req_id] = _tensors(self._chunks.pop(req_id))
        return done


def _table(positions: list[TokenLogprobs]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token ids and logprobs `[P, width]` (the chosen token, then the top ones) and ranks `[P]`;
    width: the widest position's (vLLM reads only the first count + 1 of a position)."""
    width = 1 + max((len(p.top_ids) for p in positions), default=0)
    ids = np.zeros((len(positions), width), dtype=np.int32)  # [P, width]
    logprobs = np.zeros((len(positions), width), dtype=np.float32)  # [P, width]
    ranks = np.zeros(len(positions), dtype=np.int32)  # [P]
    for i, p in enumerate(positions):
        n = len(p.top_ids)
        ids[i, 0], logprobs[i, 0], ranks[i] = p.token_id, p.logprob, p.rank
        ids[i, 1 : 1 + n] = p.top_ids
        logprobs[i, 1 : 1 + n] = p.top_logprobs
    return ids, logprobs, ranks


def _tensors(positions: list[TokenLogprobs]) -> LogprobsTensors:
    # Fresh tensors (not views of the arrays): vLLM's serializer reads a tensor's bytes through a flat
    # view, which a numpy-strided size-1 dimension can refuse.
    return LogprobsTensors(*(torch.tensor(array) for array in _table(positions)))


def _sample_lists(rows: list[TokenLogprobs | None]) -> LogprobsLists:
    """One row per request; a row that did not ask (or sampled nothing) gets zeros, never read."""
    blank = TokenLogprobs(0, 0.0, 0, (), ())
    ids, logprobs, ranks = _table([row or blank for row in rows])
    return LogprobsLists(ids, logprobs, ranks)


def _spec_lists(runs: list[list[int]], rows: list[list[TokenLogprobs] | None]) -> LogprobsLists:
    """Speculative decoding: one row per token of each request's run, the requests' runs one after the
    other (`cu_num_generated_tokens`: where each request's rows start, as vLLM slices them)."""
    flat: list[TokenLogprobs | None] = []
    starts: list[int] = []
    for run, row in zip(runs, rows, strict=True):
        starts.append(len(flat))
        flat.extend(row if row is not None else [None] * len(run))
    lists = _sample_lists(flat)
    return lists._replace(cu_num_generated_tokens=starts)


def vllm_output(output: ModelRunnerOutput, step: SchedulerOutput, prompts: PromptLogprobs) -> VllmModelRunnerOutput:
    """Our step output as vLLM's: per sampling request its tokens (one, or under speculation its
    accepted drafts and one more: vLLM's scheduler reconciles its drafts and stops inside the run),
    none for a partial prefill chunk, with the logprobs its requests asked for."""
    sampling = step.sampling_req_ids
    req_ids = list(output.req_ids)
    runs = output.spec_token_ids or [[token] for token in output.sampled_token_ids]
    tokens = [list(run) if req_id in sampling else [] for req_id, run in zip(req_ids, runs, strict=True)]
    if output.spec_logprobs is not None:
        logprobs = _spec_lists(tokens, output.spec_logprobs)
    else:
        logprobs = _sample_lists(output.logprobs) if output.logprobs is not None else None
    return VllmModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=tokens,
        logprobs=logprobs,
        prompt_logprobs_dict=prompts.take(step, output),
    )
