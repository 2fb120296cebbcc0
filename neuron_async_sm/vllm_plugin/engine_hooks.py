"""What vLLM's engine core does that our trace needs: applied steps (AdvanceStep), aborts, masks.

A `vllm.general_plugins` entry point (`install`), loaded by vLLM in its engine-core process, wraps
four methods of vLLM's `Scheduler` (and so of its `AsyncScheduler`) when our platform is active and
our trace is on: `update_from_output` records who got a token and who finished why, `finish_requests`
records aborts, and `schedule` hands what was recorded since its previous call to the workers with
the step it returns (an attribute of vLLM's SchedulerOutput, pickled along to every rank);
`get_grammar_bitmask` notes on its GrammarOutput how many tokens each row's grammar had taken (the
trace's `mask` event: FreshMaskInv). The
output rank's worker writes those records into the trace when that step reaches it: in the engine
core they happened after the worker's previous step and before this one, the order the trace keeps.
A step whose mask vLLM deferred is the exception: the engine core applies the step in flight (and
the aborts that came meanwhile) between execute_model() and sample_tokens(), so those records ride
on the step's GrammarOutput and reach the trace before its `mask` event, as they happened.
Observation only: nothing vLLM decides changes.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from neuron_async_sm.vllm_plugin import PLATFORM_CLS, register
from neuron_async_sm.vllm_plugin.config import PluginOptions

EVENTS_ATTR = "neuron_async_sm_events"  # on vLLM's SchedulerOutput: [(event, fields), ...]
ORDINAL_ATTR = "neuron_async_sm_ordinal"  # on vLLM's SchedulerOutput: its index among the engine's steps
GRAMMAR_TOKENS_ATTR = "neuron_async_sm_grammar_tokens"  # on vLLM's GrammarOutput: per row, tokens its grammar took


def install() -> None:
    """vLLM calls this in each of its processes; only where our platform is active does it do anything."""
    if register() != PLATFORM_CLS:
        return
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler, "_neuron_async_sm_hooked", False):
        return  # vLLM may load general plugins more than once per process
    Scheduler._neuron_async_sm_hooked = True
    Scheduler.schedule = _on_schedule(Scheduler.schedule)
    Scheduler.update_from_output = _on_update(Scheduler.update_from_output)
    Scheduler.finish_requests = _on_finish_requests(Scheduler.finish_requests)
    Scheduler.get_grammar_bitmask = _on_grammar_bitmask(Scheduler.get_grammar_bitmask)


def _recording(scheduler: Any) -> list | None:
    """The scheduler's record of events since its last step, or None when our trace is off."""
    records = getattr(scheduler, "_neuron_async_sm_records", False)
    if records is False:
        traced = PluginOptions.of(scheduler.vllm_config.additional_config).trace_path is not None
        records = [] if traced else None
        scheduler._neuron_async_sm_records = records
        scheduler._neuron_async_sm_ordinal = 0
    return records


def _on_schedule(schedule):
    @functools.wraps(schedule)
    def wrapper(self, *args, **kwargs):
        output = schedule(self, *args, **kwargs)
        records = _recording(self)
        if records is not None:
            setattr(output, ORDINAL_ATTR, self._neuron_async_sm_ordinal)
            setattr(output, EVENTS_ATTR, list(records))
            self._neuron_async_sm_ordinal += 1
            records.clear()
        return output

    return wrapper


def _on_update(update_from_output):
    @functools.wraps(update_from_output)
    def wrapper(self, scheduler_output, model_runner_output):
        outputs = update_from_output(self, scheduler_output, model_runner_output)
        records = _recording(self)
        ordinal = getattr(scheduler_output, ORDINAL_ATTR, None)
        if records is not None and ordinal is not None and scheduler_output.total_num_scheduled_tokens:
            delivered, finished, counts = [], [], []
            for engine_outputs in outputs.values():
                for out in engine_outputs.outputs:
                    if out.new_token_ids:
                        delivered.append(out.request_id)
                        counts.append(len(out.new_token_ids))
                    if out.finish_reason is not None:
                        finished.append([out.request_id, str(out.finish_reason)])
            fields = {"ordinal": ordinal, "delivered": delivered, "finished": finished}
            if self.num_spec_tokens:  # speculative: how many tokens each of `delivered` got (a run, cut at a stop)
                fields["counts"] = counts
            records.append(("AdvanceStep", fields))
        return outputs

    return wrapper


def _on_finish_requests(finish_requests):
    @functools.wraps(finish_requests)
    def wrapper(self, request_ids, finished_status):
        finished = finish_requests(self, request_ids, finished_status)
        records = _recording(self)
        if records is not None and str(finished_status) == "FINISHED_ABORTED":
            records.extend(("Abort", {"req_id": request.request_id}) for request in finished)
        return finished

    return wrapper


def _on_grammar_bitmask(get_grammar_bitmask):
    @functools.wraps(get_grammar_bitmask)
    def wrapper(self, scheduler_output):
        grammar_output = get_grammar_bitmask(self, scheduler_output)
        records = _recording(self)
        if records is None:
            return grammar_output
        if grammar_output is None and records:
            # A deferred mask whose rows all finished with the step just applied: no rows, but the
            # records of that step must still reach the trace before this step's mask event.
            from vllm.v1.core.sched.output import GrammarOutput

            grammar_output = GrammarOutput([], np.zeros((0, 0), dtype=np.int32))
        if grammar_output is not None:
            # A grammar takes exactly its request's outputs as the engine core applies them
            # (update_from_output's accept_tokens), so their count is what it has taken.
            counts = [self.requests[r].num_output_tokens for r in grammar_output.structured_output_request_ids]
            setattr(grammar_output, GRAMMAR_TOKENS_ATTR, counts)
            # What the engine core did since this step was scheduled: for a deferred mask, the step in
            # flight applied (and aborts) just now, before this mask was built.
            setattr(grammar_output, EVENTS_ATTR, list(records))
            records.clear()
        return grammar_output

    return wrapper
