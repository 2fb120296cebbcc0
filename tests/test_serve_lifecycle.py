"""The server under pressure and at its end, on real `serve` processes (tiny-llama, token ids): overload
is refused at once with 503 and SIGTERM then drains open streams and exits 0 (one process, the two in
turn), and a dead device ends every open stream with an error and turns /health to 503 (its own).
Nothing here waits unbounded.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import openai
import pytest
from support.processes import device_pid
from support.serve_harness import ServerProcess

LONG = dict(max_tokens=300, temperature=0.0, extra_body={"ignore_eos": True})


def flags(*extra: str) -> list[str]:
    # 20 ms per program: a 300-token request runs for seconds, so streams are really open when we act.
    return ["--device-time-ms", "20", "--max-model-len", "512", *extra]


class OpenStream(threading.Thread):
    """A streaming client on its own thread: tokens so far, how it ended (finish reason or the error)."""

    def __init__(self, server: ServerProcess, prompt: list[int], **kwargs) -> None:
        super().__init__(daemon=True)
        self.server, self.prompt, self.kwargs = server, prompt, kwargs
        self.tokens: list[int] = []
        self.ended: str | None = None
        self.error: Exception | None = None
        self.first = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            stream = self.server.client().completions.create(
                model="tiny-llama", prompt=self.prompt, stream=True, **self.kwargs
            )
            self.stream = stream
            for chunk in stream:
                for choice in chunk.choices:
                    self.tokens.extend(choice.token_ids)
                    self.ended = choice.finish_reason or self.ended
                self.first.set()
        except Exception as exc:  # what the client saw
            self.error = exc
        finally:
            self.first.set()

    def finish(self, timeout_s: float = 30.0) -> None:
        self.join(timeout_s)
        assert not self.is_alive(), "a stream never ended"


def test_more_waiting_than_max_waiting_get_503_at_once_and_sigterm_drains_then_exits_0(tmp_path):
    # One server for both (a server start is ~2-3 s of CI): the overload first, then the drain on SIGTERM.
    stats = tmp_path / "stats.json"
    server = ServerProcess(
        tmp_path,
        "tiny-llama",
        *flags("--device", "cpu-inprocess", "--max-num-seqs", "2", "--decode-buckets", "1,2", "--max-waiting", "2"),
        *("--shutdown-timeout-s", "3", "--stats", str(stats)),
    )
    try:
        more_waiting_than_max_waiting_get_503_at_once(server)
        sigterm_lets_short_streams_finish_aborts_the_rest_and_exits_0(server, stats)
    finally:
        if server.proc.poll() is None:
            server.kill()


def more_waiting_than_max_waiting_get_503_at_once(server: ServerProcess) -> None:
    streams = [OpenStream(server, [5 + i, 6, 7], **LONG) for i in range(4)]
    server.wait_for(
        lambda: server.metric("vllm:num_requests_running") == 2 and server.metric("vllm:num_requests_waiting") == 2,
        "2 running, 2 waiting",
    )
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as info:
        server.client().completions.create(model="tiny-llama", prompt=[9, 9], max_tokens=2)
    assert time.monotonic() - started < 5, "an overloaded server must refuse at once, not queue"
    assert info.value.status_code == 503 and info.value.body["code"] == "overloaded", info.value.body
    assert info.value.response.headers["retry-after"] == "1"  # when to try again
    assert server.metric("neuron_async_sm_requests_rejected_total", reason="overloaded") == 1
    for stream in streams:
        stream.stream.close()  # every client leaves: their requests are aborted, slots come back
    server.wait_for(
        lambda: server.metric("neuron_async_sm_kv_slots_free") == 2 and server.metric("vllm:num_requests_waiting") == 0,
        "slots back",
    )
    assert server.client().completions.create(model="tiny-llama", prompt=[9, 9], max_tokens=2).choices


def sigterm_lets_short_streams_finish_aborts_the_rest_and_exits_0(server: ServerProcess, stats: Path) -> None:
    short = OpenStream(server, [5, 6, 7], max_tokens=10, temperature=0.0, extra_body={"ignore_eos": True})
    long = OpenStream(server, [8, 9], **LONG)
    assert short.first.wait(30) and long.first.wait(30)
    sent = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert server.get("/health", timeout_s=2)[0] == 0, "a draining server must not take new connections"
    short.finish()
    long.finish()
    code = server.terminate(timeout_s=20)
    assert code == 0, server.log()
    assert (len(short.tokens), short.ended, short.error) == (10, "length", None)
    assert isinstance(long.error, openai.APIError) and "shutting down" in str(long.error), long.error
    assert 0 < len(long.tokens) < 300
    assert time.monotonic() - sent < 3 + 10, "the drain must end at --shutdown-timeout-s"
    assert "Aborting 1 requests still open after 3 s" in server.log(), server.log()  # the operator is told
    written = json.loads(stats.read_text())  # --stats: the engine's statistics, written when it stopped
    assert written["output_tokens"] >= len(short.tokens) + len(long.tokens) and written["steps"] > 0, written


def test_serve_takes_no_flag_it_would_ignore_and_states_its_own_exit_codes(capsys):
    from neuron_async_sm.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--no-progress"])  # serve has no progress bar
    assert exit_.value.code == 2
    capsys.readouterr()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    epilog = capsys.readouterr().out.split("exit codes:", 1)[1]
    assert "SIGTERM" in epilog and "130" in epilog and "143" not in epilog and "still written" not in epilog


def test_a_dead_device_ends_every_open_stream_with_an_error_and_the_server_exits_1(tmp_path):
    # As vLLM's API server does: a server whose engine died exits, so that its supervisor restarts it
    # (it used to answer 503 forever).
    # 32 streams (the done-when), every one holding a KV slot.
    server = ServerProcess(
        tmp_path,
        "tiny-llama",
        *flags("--device", "cpu", "--device-timeout-s", "5", "--max-num-seqs", "32", "--decode-buckets", "1,8,32"),
    )
    try:
        streams = [OpenStream(server, [5 + i, 6], **LONG) for i in range(32)]
        assert all(s.first.wait(30) for s in streams)
        os.kill(device_pid(server.proc.pid), signal.SIGKILL)
        killed = time.monotonic()
        for stream in streams:
            stream.finish(timeout_s=30)
            assert isinstance(stream.error, openai.APIError) and "engine failed" in str(stream.error), stream.error
        code = server.proc.wait(timeout=30)
        print(f"\nexit {code} {time.monotonic() - killed:.2f} s after the device was killed")
        assert code == 1 and time.monotonic() - killed < 10, (code, server.log())
        assert "The engine died" in server.log() and "error: the engine died: " in server.log(), server.log()
    finally:
        server.kill()
