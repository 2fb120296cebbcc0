"""A real `neuron-async-sm serve` process for the server tests: a small text model, a free port,
bounded waits, the official `openai` client, and the /metrics scrape parsed. Test-side only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]  # tests/support/ -> the repository
SPECIAL = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: the checkpoint's bos 1 and eos 2
ROLES = ["system", "user", "assistant"]
WORDS = [f"w{i}" for i in range(len(SPECIAL), 64 - len(ROLES))]
CHAT_TEMPLATE = (
    "{{ bos_token }} {% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)


# Where current transformers saves a chat template is chat_template.jinja; a config's own template is
# then stale. This one fails if it is ever rendered in place of the file.
STALE_CONFIG_TEMPLATE = "{{ raise_exception('the config template was rendered, not chat_template.jinja') }}"


def write_text_model(path: Path, *, chat_template: bool | str = True, **fields: object) -> Path:
    """A random 64-token Llama checkpoint with a whitespace WordLevel tokenizer (and a chat template:
    in tokenizer_config.json, or with `chat_template="jinja"` in chat_template.jinja beside a stale one);
    `fields`: config.json fields to add or change."""
    from test_model_loader import write_checkpoint
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    write_checkpoint(path, **fields)
    vocab = {token: i for i, token in enumerate([*SPECIAL, *WORDS, *ROLES])}
    assert len(vocab) == 64
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    if chat_template == "jinja":
        (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
        config["chat_template"] = STALE_CONFIG_TEMPLATE
    elif chat_template:
        config["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def in_context(tokenizer: object, prompt_ids: list[int], output_ids: list[int]) -> str:
    """An output's text as vLLM's server writes it (and ours): decoded after its prompt, i.e. the whole
    sequence decoded at once minus the prompt's text. `tokenizer`: a tokenizers.Tokenizer."""
    whole, head = tokenizer.decode(prompt_ids + output_ids), tokenizer.decode(prompt_ids)  # type: ignore[attr-defined]
    assert whole.startswith(head), (whole, head)
    return whole[len(head) :]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m neuron_async_sm serve` on 127.0.0.1; its log goes to a file (a full pipe would block it)."""

    def __init__(self, tmp_path: Path, model: str, *flags: str, start_timeout_s: float = 90.0) -> None:
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / f"server-{self.port}.log"
        argv = [
            sys.executable,
            "-m",
            "neuron_async_sm",
            "serve",
            "--model",
            model,
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *flags,
        ]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + start_timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the server exited at start:\n{self.log()}"
            if self.get("/health", timeout_s=2)[0] == 200:
                return
            time.sleep(0.1)
        self.kill()
        raise AssertionError(f"the server did not answer /health within {start_timeout_s} s:\n{self.log()}")

    def get(self, path: str, timeout_s: float = 10.0) -> tuple[int, bytes]:
        return self.request("GET", path, None, timeout_s=timeout_s)

    def request(self, method: str, path: str, body: bytes | None, timeout_s: float = 30.0) -> tuple[int, bytes]:
        """(status, body) of a raw HTTP request; status 0 when nothing answered."""
        req = urllib.request.Request(
            self.url + path, data=body, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
        except OSError:
            return 0, b""

    def post(self, path: str, body: dict, timeout_s: float = 30.0) -> tuple[int, object]:
        """POST a JSON body exactly as given (no client's defaults added); (status, the JSON answer)."""
        status, answer = self.request("POST", path, json.dumps(body).encode(), timeout_s=timeout_s)
        return status, json.loads(answer) if answer else None

    def get_json(self, path: str) -> object:
        status, answer = self.get(path)
        assert status == 200, (status, answer)
        return json.loads(answer)

    def sse(self, path: str, body: dict, timeout_s: float = 30.0) -> list[str]:
        """POST a streaming body; the `data:` payloads of the answer, [DONE] included."""
        status, answer = self.request("POST", path, json.dumps(body).encode(), timeout_s=timeout_s)
        assert status == 200, (status, answer)
        lines = answer.decode().splitlines()
        return [line[len("data: ") :] for line in lines if line.startswith("data: ")]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, timeout_s: float = 60.0) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=timeout_s)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """(sample name, sorted labels without model_name) -> value."""
        status, body = self.get("/metrics")
        assert status == 200, status
        text = body.decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
                out[(sample.name, labels)] = sample.value
        return out

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def wait_for(self, predicate, what: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; metrics: {self.metrics()}")

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then the exit code (bounded: killed past timeout_s)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the server did not exit within {timeout_s} s of SIGTERM:\n{self.log()}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def serve_fixtures(
    *flags: str, write_model: Callable[[Path], Path] = write_text_model, scope: str = "module"
) -> tuple[object, object, object]:
    """The fixtures `model` (a checkpoint `write_model` writes), `server` (`serve` on it with `flags`,
    which must exit 0 on SIGTERM) and `tokenizer` (the checkpoint's) of a serve test module:
    ``model, server, tokenizer = serve_fixtures(*FLAGS)``."""

    @pytest.fixture(scope=scope, name="model")
    def model_fixture(tmp_path_factory: pytest.TempPathFactory) -> str:
        return str(write_model(tmp_path_factory.mktemp("model")))

    @pytest.fixture(scope=scope, name="server")
    def server_fixture(model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
        proc = ServerProcess(tmp_path_factory.mktemp("server"), model, *flags)
        yield proc
        assert proc.terminate() == 0, proc.log()

    @pytest.fixture(scope=scope, name="tokenizer")
    def tokenizer_fixture(model: str) -> object:  # a tokenizers.Tokenizer (imported where it is used)
        from tokenizers import Tokenizer

        return Tokenizer.from_file(f"{model}/tokenizer.json")

    return model_fixture, server_fixture, tokenizer_fixture


def offline_fixture(**engine: object) -> object:
    """The fixture `offline`: the offline `LLM` on the module's `model` with `engine` settings, on the
    in-process device (the reference a server's tokens must equal)."""

    @pytest.fixture(scope="module", name="offline")
    def offline_llm(model: str) -> Iterator[object]:
        from neuron_async_sm import LLM

        with LLM(model, device="cpu-inprocess", **engine) as llm:
            yield llm

    return offline_llm
