"""How a request ends on a real `serve` process, as the client and /metrics see it, where nothing else
looked: without max_tokens a chat runs to the context limit; a stop string ends the engine's request
as `stop` (not `abort`); every finished request feeds the latency histograms and token counters
exactly; a non-streaming request still open at the shutdown deadline gets a 503 `abort`, and one open
when the device dies a 500 `engine_error`, then the server exits 1 (the streaming cases are
tests/test_serve_lifecycle.py's).
The official `openai` client throughout.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import openai
import pytest
from support.processes import device_pid
from support.serve_harness import ServerProcess, serve_fixtures

from neuron_async_sm.worker.async_machine import ASYNC_STATES, PATH_STATES

LONG = dict(max_tokens=100, temperature=0.0, extra_body={"ignore_eos": True})  # ~2.5 s of 25 ms programs
MAX_MODEL_LEN = 128
SLOW = ["--device-time-ms", "25", "--max-model-len", str(MAX_MODEL_LEN)]
SUCCESS = "vllm:request_success_total"


# 10 ms programs: a stop string's abort lands long before a 100-token request could end on its own
model, server, _ = serve_fixtures(
    "--device", "cpu-inprocess", "--device-time-ms", "10", "--max-model-len", str(MAX_MODEL_LEN)
)


class Counters:
    """Metric values relative to when it was made."""

    def __init__(self, server: ServerProcess) -> None:
        self.server, self.before = server, server.metrics()

    def __call__(self, name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return self.server.metric(name, **labels) - self.before.get(key, 0.0)


def test_a_stop_string_ends_the_engine_request_as_stop_not_abort(server):
    client = server.client()
    probe = client.completions.create(model=server.model, prompt="w5 w9 w17", **dict(LONG, max_tokens=8))
    stop_word = probe.choices[0].text.split()[-1]  # a word it reaches within 8 tokens
    for stream in (False, True):
        delta = Counters(server)
        out = client.completions.create(model=server.model, prompt="w5 w9 w17", stop=[stop_word], stream=stream, **LONG)
        chunks = list(out) if stream else [out]
        assert chunks[-1].choices[0].finish_reason == "stop"
        ended = {reason: 0.0 for reason in ("stop", "length", "abort", "error")}

        def settled(d: Counters = delta, ended: dict = ended) -> bool:
            ended.update((reason, d(SUCCESS, finished_reason=reason)) for reason in ended)
            return sum(ended.values()) >= 1

        server.wait_for(settled, "the request to end in the engine")
        assert ended == {"stop": 1, "length": 0, "abort": 0, "error": 0}, (stream, ended)
        generated = delta("vllm:generation_tokens_total")
        print(f"stop string, stream={stream}: the engine generated {generated:.0f} tokens")
        assert generated < LONG["max_tokens"] / 2, stream


def test_finished_requests_feed_every_histogram_and_token_counter_exactly(server):
    delta = Counters(server)
    plans = [([5, 6, 7], 4), ([8, 9], 7), ([10], 1), ([11, 12, 13, 14], 5)]
    for prompt, max_tokens in plans:
        out = server.client().completions.create(
            model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, extra_body={"ignore_eos": True}
        )
        assert out.usage.completion_tokens == max_tokens
    server.wait_for(lambda: delta(SUCCESS, finished_reason="length") == len(plans), "every request to finish")
    tokens = sum(m for _, m in plans)
    assert delta("vllm:prompt_tokens_total") == sum(len(p) for p, _ in plans)
    assert delta("vllm:generation_tokens_total") == tokens
    assert delta("vllm:time_to_first_token_seconds_count") == len(plans)
    assert delta("vllm:inter_token_latency_seconds_count") == tokens - len(plans)
    assert delta("vllm:e2e_request_latency_seconds_count") == len(plans)
    assert delta("vllm:e2e_request_latency_seconds_sum") > 0
    # Every step was counted by its path, and each output brought to the host once.
    steps = {state: server.metric("neuron_async_sm_steps_total", state=state) for state in PATH_STATES}
    total = sum(steps.values())
    metrics = server.metrics()
    materialized = sum(v for (name, _), v in metrics.items() if name == "neuron_async_sm_materializations_total")
    assert total > 0 and materialized == total, (steps, materialized)
    fraction = server.metric("neuron_async_sm_async_step_fraction")
    assert fraction == pytest.approx(sum(steps[s] for s in ASYNC_STATES) / total), steps
    assert steps["Relay"] > 0, steps  # the relay is on by default: the fraction counts it


def test_without_max_tokens_a_chat_runs_to_the_context_limit_and_a_completion_to_16(server):
    """OpenAI's (and vLLM's) defaults: a chat gets whatever the context has room for, a completion 16."""
    greedy = dict(temperature=0.0, extra_body={"ignore_eos": True})
    messages = [{"role": "user", "content": "w5 w9"}]
    chat = server.client().chat.completions.create(model=server.model, messages=messages, **greedy)
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == MAX_MODEL_LEN
    assert chat.choices[0].finish_reason == "length"
    out = server.client().completions.create(model=server.model, prompt=[5, 9, 17], **greedy)
    assert (out.usage.completion_tokens, out.choices[0].finish_reason) == (16, "length")
    unbounded = dict(greedy, extra_body={"ignore_eos": True, "max_tokens": None})  # sent as null
    out = server.client().completions.create(model=server.model, prompt=[5, 9, 17], **unbounded)
    assert (out.usage.completion_tokens, out.choices[0].finish_reason) == (MAX_MODEL_LEN - 3, "length")


class OpenRequest(threading.Thread):
    """A non-streaming completion on its own thread: what the client got back."""

    def __init__(self, server: ServerProcess) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.error: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            self.server.client().completions.create(model=self.server.model, prompt=[5, 9, 17], **LONG)
        except Exception as exc:  # what the client saw
            self.error = exc

    def finish(self, timeout_s: float = 30.0) -> openai.APIStatusError:
        self.join(timeout_s)
        assert not self.is_alive(), "the request never ended"
        assert isinstance(self.error, openai.APIStatusError), self.error
        return self.error


def test_a_non_streaming_request_open_at_the_shutdown_deadline_gets_503_abort(model, tmp_path):
    server = ServerProcess(tmp_path, model, "--device", "cpu-inprocess", "--shutdown-timeout-s", "0.5", *SLOW)
    try:
        request = OpenRequest(server)
        server.wait_for(lambda: server.metric("vllm:num_requests_running") == 1, "the request to run")
        server.proc.send_signal(signal.SIGTERM)
        error = request.finish()
        assert error.status_code == 503 and error.body["code"] == "abort", error.body
        assert "shutting down" in error.body["message"], error.body
        assert server.terminate() == 0, server.log()
    finally:
        server.kill()


def test_a_non_streaming_request_open_when_the_device_dies_gets_500_and_the_server_exits_1(model, tmp_path):
    server = ServerProcess(tmp_path, model, "--device", "cpu", "--device-timeout-s", "5", *SLOW)
    try:
        request = OpenRequest(server)
        server.wait_for(lambda: server.metric("vllm:num_requests_running") == 1, "the request to run")
        os.kill(device_pid(server.proc.pid), signal.SIGKILL)
        killed = time.monotonic()
        error = request.finish()
        assert error.status_code == 500 and error.body["code"] == "engine_error", error.body
        assert error.body["message"].startswith("the engine failed: "), error.body
        # Then the server stops serving and exits 1 (vLLM's API server does the same), for its supervisor.
        assert server.proc.wait(timeout=30) == 1 and time.monotonic() - killed < 10, server.log()
    finally:
        server.kill()
