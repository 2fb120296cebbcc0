"""Warm-up covers every program shape serving enqueues, the relay's included (issue 12: no compile while serving).

A compiling device (XLA, Neuron) builds one program per input signature. Here the CPU plays one: the
accelerator backend on the CPU told it compiles per shape (so the worker pads the relay input as it does
on XLA), and a program factory that logs each call's signature: a signature first seen after warm-up
is a program XLA would have compiled while serving. Runs in the main environment, in seconds.
"""

from __future__ import annotations

import random

import torch
from support.workloads import drive, random_workload

from neuron_async_sm import LLM
from neuron_async_sm.engine import core
from neuron_async_sm.runtime.accelerator_runtime import AcceleratorOps
from neuron_async_sm.worker.model_runner import RELAY_PAD_PROGRAM

SHAPES = dict(
    dtype="float64",
    max_num_seqs=4,
    max_model_len=128,
    max_num_batched_tokens=16,  # long prompts are chunked: mixed steps beside decodes
    prefill_buckets=(8, 16),
    decode_buckets=(1, 2, 4, 8),
)

Signature = tuple[str, tuple[tuple[str, tuple[int, ...], torch.dtype], ...]]


class SignatureLoggingFactory(core.StepProgramFactory):
    """The engine's programs, each call logging (program, input names, shapes, dtypes) to `calls`."""

    calls: list[Signature] = []

    def __call__(self, device: torch.device) -> dict:
        def logged(name: str, program):
            def call(**inputs: torch.Tensor) -> torch.Tensor:
                shapes = tuple(sorted((k, tuple(v.shape), v.dtype) for k, v in inputs.items()))
                SignatureLoggingFactory.calls.append((name, shapes))
                return program(**inputs)

            return call

        return {name: logged(name, program) for name, program in super().__call__(device).items()}


def test_serving_with_the_relay_enqueues_no_signature_warm_up_did_not(monkeypatch):
    monkeypatch.setattr(AcceleratorOps, "compiles", True)
    monkeypatch.setattr(core, "StepProgramFactory", SignatureLoggingFactory)
    monkeypatch.setattr(SignatureLoggingFactory, "calls", [])
    rng = random.Random(4321)
    workloads = [random_workload(rng, f"w{n}", max_prompt=40) for n in range(4)]
    with LLM("tiny-llama", device="accelerator", async_scheduling=True, **SHAPES) as llm:
        warmed = set(SignatureLoggingFactory.calls)
        for items in workloads:
            drive(llm, items, aborts=True)
        stats = llm.stats()
    served = set(SignatureLoggingFactory.calls)
    assert stats["state_counts"]["Relay"] > 0, stats  # the relay is on (the default) and churn relays
    assert any(name == RELAY_PAD_PROGRAM for name, _ in served), "the relay input was not padded"
    assert served - warmed == set(), "serving enqueued a signature warm-up did not compile"
    assert stats["compilations"] == 0  # the key is there on a compiling device
