"""`vllm serve <checkpoint>` with our plugin answers the official `openai` client (the plugin lane), and
lm-eval's loglikelihood request (`echo` with `logprobs`) as our own `serve` does.

The server is vLLM's own CLI on a fresh 127.0.0.1 port, in its own process group, killed with it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.serve_harness import ServerProcess, free_port, write_text_model
from support.vllm_harness import needs_vllm, vllm_env

pytestmark = needs_vllm

START_TIMEOUT_S = 180.0
PROMPT = "w3 w14 w25 w36 w47"


def get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of one Prometheus metric's samples whose labels include `labels`."""
    _, text = get(f"{url}/metrics")
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[str, str]]:
    """`vllm serve` on a fresh port; yields (base url, model name). One running request at a time."""
    folder = tmp_path_factory.mktemp("serve")
    ckpt = str(write_text_model(folder / "ckpt", model_type="llama", torch_dtype="float32"))
    port = free_port()
    argv = [
        str(Path(sys.executable).parent / "vllm"),
        "serve",
        ckpt,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-num-seqs",
        "1",
        "--max-model-len",
        "64",
        "--additional-config",
        json.dumps({"neuron_async_sm": {"device_time_ms": 20}}),  # a stream long enough to leave mid-way
    ]
    log_path = folder / "server.log"
    started = time.monotonic()
    with open(log_path, "w") as log:
        # fork: vLLM's CLI would spawn its workers, each importing vLLM again (~15 s each)
        env = vllm_env(VLLM_WORKER_MULTIPROC_METHOD="fork")
        proc = subprocess.Popen(argv, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited {proc.returncode}:\n{log_path.read_text()[-6000:]}")
            if time.monotonic() - started > START_TIMEOUT_S:
                pytest.fail(f"vllm serve not ready in {START_TIMEOUT_S:.0f} s:\n{log_path.read_text()[-6000:]}")
            try:
                status, body = get(f"{url}/v1/models", timeout=2)
            except OSError:
                status, body = 0, ""
            # Our server, not another process on a recycled port: it serves this checkpoint.
            if status == 200 and json.loads(body)["data"][0]["id"] == ckpt:
                break
            time.sleep(0.5)
        print(f"vllm serve ready in {time.monotonic() - started:.1f} s")
        yield url, ckpt
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def client(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_vllm_serve_answers_the_openai_client_streaming_and_not(server):
    url, model = server
    openai = client(url)
    params = dict(model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    whole = openai.completions.create(**params)
    assert whole.usage.completion_tokens == 8 and whole.choices[0].finish_reason == "length"
    pieces = [chunk.choices[0].text for chunk in openai.completions.create(**params, stream=True) if chunk.choices]
    assert "".join(pieces) == whole.choices[0].text
    assert len(whole.choices[0].text.split()) == 8  # one word per token (a whitespace word-level vocabulary)
    assert metric(url, "vllm:num_requests_running") == 0


def test_a_client_leaving_mid_stream_frees_its_request(server):
    url, model = server
    openai = client(url)
    tokens_before = metric(url, "vllm:generation_tokens_total")
    stream = openai.completions.create(
        model=model, prompt=PROMPT, max_tokens=50, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()  # the client leaves with ~47 tokens to go (a second or more at 20 ms a step)
    deadline = time.monotonic() + 30
    while metric(url, "vllm:num_requests_running") > 0:
        assert time.monotonic() < deadline, "the request its client left is still running"
        time.sleep(0.2)
    time.sleep(1.5)  # had it gone on, it would produce its 50 tokens by now
    produced = metric(url, "vllm:generation_tokens_total") - tokens_before
    assert produced < 25, f"the request ran on after its client left: {produced:.0f} tokens"
    # One running request at a time (--max-num-seqs 1): the next one runs only if the slot was freed.
    after = openai.completions.create(model=model, prompt=PROMPT, max_tokens=4, extra_body={"ignore_eos": True})
    assert after.usage.completion_tokens == 4


def test_a_request_our_platform_refuses_is_a_400_naming_the_field(server):
    """validate_request's refusal reaches the client as vLLM's own validation errors do (a plain
    ValueError there became a 500 without a message)."""
    url, model = server
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "logprobs": 1, "logprob_token_ids": [3]}
    with pytest.raises(urllib.error.HTTPError) as refused:
        completions(url, body)
    error = json.loads(refused.value.read())["error"]
    assert refused.value.code == 400 and error["param"] == "logprob_token_ids", error
    assert "logprob_token_ids=[3] is not supported" in error["message"], error


def completions(url: str, body: dict) -> dict:
    """POST a JSON body as given (no client's defaults added) to /v1/completions; its JSON answer."""
    request = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


# float32 logprobs of one token may differ in the last bits between two engines' batches
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def ours(server, tmp_path_factory) -> Iterator[ServerProcess]:
    """Our own `serve` on the same checkpoint."""
    proc = ServerProcess(tmp_path_factory.mktemp("ours"), server[1])
    yield proc
    assert proc.terminate() == 0, proc.log()


def test_echo_with_logprobs_equals_our_serve_token_for_token(server, ours):
    """What lm-eval's loglikelihood sends (`local-completions`' defaults): token ids, `echo`,
    `logprobs=1`, `max_tokens=1`, temperature 0, two prompts in one request as its batches do. vLLM's
    server with our plugin answers as our own `serve` does on the same checkpoint: every prompt and
    output token, its logprob and its top-1, the text offsets, the text, the finish reason and the counts."""
    url, model = server
    context = [1, 7, 19, 31, 43]
    prompts = [[*context, 12, 24], [*context, 50]]
    body = {"model": model, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234}
    body["echo"] = True
    theirs = completions(url, body)
    status, ours = ours.post("/v1/completions", body)
    assert status == 200, ours
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [theirs["usage"][k] for k in counts] == [ours["usage"][k] for k in counts], (theirs["usage"], ours["usage"])
    assert len(theirs["choices"]) == len(ours["choices"]) == len(prompts)
    for prompt, a, b in zip(prompts, theirs["choices"], ours["choices"], strict=True):
        assert a["index"] == b["index"] and a["finish_reason"] == b["finish_reason"] == "length"
        got, want = a["logprobs"], b["logprobs"]
        # lm-eval sums token_logprobs[ctxlen:-1] and compares each with its top_logprobs' best
        assert got["tokens"] == want["tokens"] and len(got["tokens"]) == len(prompt) + 1, (got, want)
        assert got["text_offset"] == want["text_offset"]
        assert got["token_logprobs"][0] is None and want["token_logprobs"][0] is None  # the first token has none
        for x, y in zip(got["token_logprobs"][1:], want["token_logprobs"][1:], strict=True):
            assert abs(x - y) <= LOGPROB_TOL, (got, want)
        assert got["top_logprobs"][0] is None and want["top_logprobs"][0] is None
        for x, y in zip(got["top_logprobs"][1:], want["top_logprobs"][1:], strict=True):
            assert list(x) == list(y) and all(abs(x[t] - y[t]) <= LOGPROB_TOL for t in x), (got, want)
        # The prompt's text (its <s> kept), then the output decoded after it: "... w24 w29", not "... w24w29".
        assert a["text"] == b["text"] == " ".join(got["tokens"]), (a["text"], b["text"])


def sse_text(url: str, path: str, body: dict) -> str:
    """The text of a streamed answer (completions' `text`, chat's `delta.content`)."""
    request = urllib.request.Request(
        f"{url}{path}", data=json.dumps({**body, "stream": True}).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        lines = response.read().decode().splitlines()
    choices = [c for line in lines if line.startswith("data: {") for c in json.loads(line[6:])["choices"]]
    return "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in choices)


def test_completion_and_chat_text_equal_our_serve_streamed_and_not(server, ours):
    """Greedy text after a text prompt and after a chat, and a stop string that begins with the space
    before an output word: vLLM's server and ours write the same text, streamed and not."""
    url, model = server
    common = {"model": model, "temperature": 0, "max_tokens": 6, "ignore_eos": True}
    bodies = {"/v1/completions": {**common, "prompt": PROMPT}}
    bodies["/v1/chat/completions"] = {**common, "messages": [{"role": "user", "content": "w5 w6"}]}
    for path, body in bodies.items():
        plain = sse_text(url, path, body)
        stop = " " + plain.split()[2]  # its first occurrence ends the text before it
        for request in (body, {**body, "stop": [stop]}):
            theirs = sse_text(url, path, request)
            assert theirs == sse_text(ours.url, path, request), (path, request)
            status, answer = ours.post(path, request)
            [choice] = answer["choices"]
            assert status == 200 and (choice.get("text") or choice.get("message", {}).get("content")) == theirs
        assert plain.startswith(" w") and theirs == plain[: plain.index(stop)]
