"""Trace validation: an NDJSON trace (`--trace`) becomes a TLA+ module, TLC replays it against the spec.

TLC 2.15 cannot read JSON, so the trace is written as a constant sequence of records (`TraceLog.tla`)
next to copies of the spec modules in a scratch directory. `TraceAsyncScheduling` prints the furthest
event it matched; the trace is a behaviour of the spec when that is the last event.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from tlc import SPEC_DIR, TlcResult, run_tlc, tla

TRACE_MODULE = "TraceAsyncScheduling"
SPEC_MODULES = ("AsyncScheduling.tla", "TraceAsyncScheduling.tla", "TraceAsyncScheduling.cfg")
LOGGED_EVENTS = ("step", "reinstate", "drain", "Materialize")
THREADS = ("MainThread", "async-output")
_MATCHED = re.compile(r'<<"matched", (\d+), (\d+)>>')


@dataclass(frozen=True)
class TraceVerdict:
    """How far TLC could follow a trace, and the first event it could not take."""

    events: list[dict]  # the logged events, as recorded (without the header)
    matched: int  # events matched, in order, from the start
    tlc: TlcResult

    @property
    def accepted(self) -> bool:
        return self.tlc.exit_code == 0 and self.matched == len(self.events)

    @property
    def rejected_event(self) -> dict | None:
        return None if self.accepted or self.matched >= len(self.events) else self.events[self.matched]

    def describe(self) -> str:
        if self.accepted:
            return f"accepted: {self.matched}/{len(self.events)} events in {self.tlc.elapsed_s:.1f}s"
        if self.tlc.exit_code != 0:
            return f"TLC failed (exit {self.tlc.exit_code}):\n{self.tlc.errors()}"
        return f"rejected at event {self.matched} of {len(self.events)} (0-based): {json.dumps(self.rejected_event)}"


def read_trace(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def trace_config(events: list[dict]) -> dict:
    """The engine constants in the trace's header event."""
    for e in events:
        if e["event"] == "config":
            return e
    raise ValueError("the trace has no `config` header event (written by ModelRunner when tracing)")


def trace_records(events: Iterable[dict]) -> list[dict]:
    """The logged events as records of one shape (fields an event lacks get neutral values).

    The spec names each request once, so a request id the client reused after its request finished
    becomes a new name from its second admission on ("id#2", ...). Materialize events name the ids
    of their step's snapshot.
    """
    admissions: Counter[str] = Counter()
    current: dict[str, str] = {}  # id -> name of its latest admission
    snapshot: dict[int, list[str]] = {}  # step -> its rows, by name
    records = []
    for e in events:
        if e["event"] == "config":
            continue
        if e["event"] not in LOGGED_EVENTS:
            raise ValueError(f"unknown trace event {e['event']!r} (seq {e.get('seq')})")
        if e["thread"] not in THREADS:
            raise ValueError(f"unknown thread {e['thread']!r} (seq {e.get('seq')})")
        materialize = e["event"] == "Materialize"
        new = e.get("new", []) if e["event"] == "step" else []
        for req_id in new:
            admissions[req_id] += 1
            current[req_id] = req_id if admissions[req_id] == 1 else f"{req_id}#{admissions[req_id]}"
        if materialize:
            req_ids = snapshot.get(e["step"], [current.get(r, r) for r in e["req_ids"]])
        else:
            req_ids = [current.get(r, r) for r in e["req_ids"]]
            if e["event"] == "step":
                snapshot[e["step"]] = req_ids
        records.append({
            "event": e["event"],
            "step": e["step"],
            "thread": e["thread"],
            "req_ids": req_ids,
            "new": [current[r] for r in new],
            "max_tokens": list(e.get("max_tokens", [])) if new else [],
            "source": "" if materialize else e["source"],
            "state": "" if materialize else e["state"],
            "sampled": [p is not None for p in e["positions"]] if materialize else [],
            "count": e["count"] if materialize else 0,
            "ok": bool(e["ok"]) if materialize else True,
            # the relay's row map, rows numbered as in the spec (1-based; 0: the row keeps its host id)
            "relay_from": [j + 1 for j in e.get("relay_from", [])][: len(req_ids)] if e["event"] == "reinstate" else [],
        })  # fmt: skip
    return records


def trace_log_module(events: list[dict]) -> str:
    """`TraceLog.tla`: the trace and the engine constants it ran with (its `config` header).

    Requests are listed in admission order (the step events' `new`), which is their arrival order:
    the scheduler admits FIFO. A request the trace never admits (aborted while waiting) is invisible
    and left out. Each request's output limit comes with its admission (`max_tokens`).
    """
    config = trace_config(events)
    records = trace_records(events)
    order: list[str] = []
    limits: dict[str, int] = {}
    last_step: dict[str, int] = {}  # request -> index of the last step event scheduling it
    admitted_at: dict[str, int] = {}  # request -> index of the step event admitting it
    next_step = [0] * (len(records) + 2)  # index -> index of the first step event at or after it
    for i, r in enumerate(records, start=1):
        if r["event"] == "step":
            order += r["new"]
            limits.update(zip(r["new"], r["max_tokens"], strict=True))
            admitted_at.update((req_id, i) for req_id in r["new"])
            for req_id in r["req_ids"]:
                last_step[req_id] = i
    following = 0
    for i in range(len(records), 0, -1):
        following = i if records[i - 1]["event"] == "step" else following
        next_step[i] = following
    chunks = config["max_model_len"]  # a bound only (a chunk has a token at least): the trace says when
    fn = "[r \\in {" + ", ".join(tla(r) for r in order) + "} |-> CASE " if order else None

    def function(values: Mapping[str, int]) -> str:
        if not order:
            return "<<>>"
        return fn + " [] ".join(f"r = {tla(r)} -> {values[r]}" for r in order) + "]"

    lines = [
        "----------------------------- MODULE TraceLog -----------------------------",
        "\\* Generated by model_check/trace_check.py from an NDJSON trace. Do not edit.",
        "EXTENDS Integers, Sequences",
        f"TraceRequests == {tla(order)}",
        f"TraceReqSet == {{{', '.join(tla(r) for r in order)}}}",
        f"TraceMaxTokens == {function(limits)}",
        f"TraceLastStep == {function(last_step)}",
        f"TraceAdmittedAt == {function(admitted_at)}",
        f"TraceNextStep == {tla(next_step[1:])}",  # indexed 1..Len(TraceEvents) + 1
        f"TraceMaxSeqs == {config['max_num_seqs']}",
        f"TraceBuckets == {tla(set(config['decode_buckets']))}",
        f"TraceMaxChunks == {chunks}",
        # Programs may fail only in a trace that shows a failure: an error or a drained engine.
        f"TraceAllowFailure == {tla(any(r['event'] == 'drain' or not r['ok'] for r in records))}",
        f"TraceAsyncRelay == {tla(bool(config.get('async_relay', False)))}",  # traces from before the relay: off
        "TraceEvents == <<",
        ",\n".join("  " + tla(r) for r in records),
        ">>",
        "=============================================================================",
    ]
    return "\n".join(lines) + "\n"


def check_trace(events: list[dict], *, timeout_s: float = 300) -> TraceVerdict:
    """Replay an async engine's trace against the spec with TLC; report how far it got."""
    module = trace_log_module(events)
    with tempfile.TemporaryDirectory(prefix="trace-check-") as scratch:
        work = Path(scratch)
        for name in SPEC_MODULES:
            shutil.copy(SPEC_DIR / name, work / name)
        (work / "TraceLog.tla").write_text(module)
        result = run_tlc(TRACE_MODULE, f"{TRACE_MODULE}.cfg", spec_dir=work, extra=("-deadlock",), timeout_s=timeout_s)
    matched = 0
    for line in result.printed:
        if m := _MATCHED.search(line):
            matched = max(matched, int(m.group(1)))
    return TraceVerdict([e for e in events if e["event"] != "config"], matched, result)


def main(argv: list[str] | None = None) -> int:
    """`python model_check/trace_check.py TRACE.ndjson`: is an async engine's trace a behaviour of the spec?"""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("trace", type=Path, help="an NDJSON trace written with --trace / LLM(trace_path=...)")
    args = parser.parse_args(argv)
    verdict = check_trace(read_trace(args.trace))
    print(verdict.describe())
    return 0 if verdict.accepted else 1


if __name__ == "__main__":
    raise SystemExit(main())
