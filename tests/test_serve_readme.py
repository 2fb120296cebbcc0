"""The README's Serve section works as written: its command starts the server, its client example runs.

The command and the example are taken from README.md verbatim. Only when port 8000 (the one they
use) is taken on this machine are both moved to a free port, and nothing else changes.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from support.processes import process_gone
from support.serve_harness import REPO, free_port


def readme_serve_section() -> tuple[str, str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("## Serve\n", 1)[1].split("\n## ", 1)[0]
    [command] = re.findall(r"```bash\n(.*?)\n```", section, re.S)
    [example] = re.findall(r"```python\n(.*?)\n```", section, re.S)
    return command, example


def port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_the_readme_serve_command_and_client_example_work_as_written(tmp_path):
    command, example = readme_serve_section()
    assert command == "neuron-async-sm serve --model tiny-llama", command
    port = 8000 if port_free(8000) else free_port()
    argv = shlex.split(command)
    argv[0] = str(Path(sys.executable).with_name(argv[0]))  # the venv's console script
    if port != 8000:
        argv += ["--port", str(port)]
        example = example.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    with open(tmp_path / "server.log", "w") as log:
        server = subprocess.Popen(argv, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()
            assert time.monotonic() < deadline, "the README's server never answered /health"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        run = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        tokens, rest = run.stdout.split("]", 1)
        assert len(tokens.strip("[").split(",")) == 8 and rest.split()[0] in ("stop", "length"), run.stdout
        assert "completion_tokens=" in rest, run.stdout
    finally:
        server.terminate()
        assert server.wait(timeout=30) == 0, (tmp_path / "server.log").read_text()
        assert process_gone(server.pid)
