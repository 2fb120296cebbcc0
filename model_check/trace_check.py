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
LOGGED_EVENTS = ("step", "reinstate", "drain", "Materialize", "AdvanceStep", "Abort")
POISON_TOKEN = -1  # neuron_async_sm.worker.input_batch.POISON_TOKEN: a token the host does not have yet
_MATCHED = re.compile(r'<<"matched", (\d+), (\d+)>>')
_CURSOR = re.compile(r"^/\\ l = (\d+)$", re.M)


@dataclass(frozen=True)
class TraceVerdict:
    """How far TLC could follow a trace, and the first event it could not take."""

    events: list[dict]  # the logged events the spec follows, as recorded (without the header)
    matched: int  # events matched, in order, from the start
    tlc: TlcResult

    @property
    def accepted(self) -> bool:
        return self.tlc.exit_code == 0 and self.matched == len(self.events)

    @property
    def violated_invariant(self) -> str | None:
        """The invariant the real run broke (TLC exit 12), or None."""
        return self.tlc.violated_invariant

    @property
    def violating_index(self) -> int | None:
        """0-based index of the event after which the invariant failed (the error trace's last cursor)."""
        if self.violated_invariant is None:
            return None
        cursors = [int(m.group(1)) for m in _CURSOR.finditer(self.tlc.output)]
        return cursors[-1] - 2 if cursors else None

    @property
    def rejected_event(self) -> dict | None:
        if self.accepted:
            return None
        if self.violating_index is not None:
            return self.events[self.violating_index]
        return None if self.matched >= len(self.events) else self.events[self.matched]

    def describe(self) -> str:
        if self.accepted:
            return f"accepted: {self.matched}/{len(self.events)} events in {self.tlc.elapsed_s:.1f}s"
        if self.violated_invariant is not None:
            return (f"rejected: {self.violated_invariant} fails after event {self.violating_index} of "
                    f"{len(self.events)} (0-based): {json.dumps(self.rejected_event)}")  # fmt: skip
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


def engine_threads(events: list[dict]) -> tuple[str, str]:
    """The engine loop's and the async output thread's names, from the trace's header."""
    config = trace_config(events)
    return config.get("engine_thread", "MainThread"), config.get("output_thread", "async-output")


def logged_events(events: Iterable[dict]) -> list[dict]:
    """The events the spec follows, as recorded. Aborts of requests no step ever admitted (aborted
    while waiting, before any trace event named them) are invisible to the spec and left out."""
    live: set[str] = set()
    kept = []
    for e in events:
        if e["event"] == "config":
            continue
        if e["event"] not in LOGGED_EVENTS:
            raise ValueError(f"unknown trace event {e['event']!r} (seq {e.get('seq')})")
        if e["event"] == "step":
            live |= set(e.get("new", []))
        elif e["event"] == "AdvanceStep":
            live -= {req_id for req_id, _ in e["finished"]}
        elif e["event"] == "Abort":
            if e["req_id"] not in live:
                continue
            live.discard(e["req_id"])
        kept.append(e)
    return kept


def _input(row: list) -> dict:
    """One row's logged input as a record: prompt, a row of the pending future (1-based), or host."""
    kind = row[0]
    return {"src": kind, "row": row[1] + 1 if kind == "future" else 0,
            "tok": row[1] if kind == "host" else 0, "pos": row[2] if kind == "host" else 0}  # fmt: skip


def trace_records(events: Iterable[dict], threads: tuple[str, str] = ("MainThread", "async-output")) -> list[dict]:
    """The logged events as records of one shape (fields an event lacks get neutral values).

    The spec names each request once, so a request id the client reused after its request finished
    becomes a new name from its second admission on ("id#2", ...). Materialize and AdvanceStep events
    name the ids of their step's snapshot. `events` are `logged_events()`.
    """
    admissions: Counter[str] = Counter()
    current: dict[str, str] = {}  # id -> name of its latest admission
    snapshot: dict[int, list[str]] = {}  # step -> its rows, by name
    raw_ids: dict[int, list[str]] = {}  # step -> its rows, by id
    records = []
    for e in events:
        if e["thread"] not in threads:
            raise ValueError(f"thread {e['thread']!r} is not the header's engine or output thread (seq {e.get('seq')})")
        kind = e["event"]
        materialize = kind == "Materialize"
        machine = kind in ("step", "reinstate", "drain")
        new = e.get("new", []) if kind == "step" else []
        for req_id in new:
            admissions[req_id] += 1
            current[req_id] = req_id if admissions[req_id] == 1 else f"{req_id}#{admissions[req_id]}"
        by_name: dict[str, str] = {}  # id -> name, in this event's step
        if kind in ("Materialize", "AdvanceStep"):
            req_ids = snapshot.get(e["step"], [current.get(r, r) for r in e.get("req_ids", [])])
            by_name = dict(zip(raw_ids.get(e["step"], []), req_ids, strict=False))
        elif machine:
            req_ids = [current.get(r, r) for r in e["req_ids"]]
            if kind == "step":
                snapshot[e["step"]], raw_ids[e["step"]] = req_ids, e["req_ids"]
        else:
            req_ids = []
        finished = e.get("finished", []) if kind == "AdvanceStep" else []
        records.append({
            "event": kind,
            "step": e.get("step", -1),
            "thread": e["thread"],
            "req_ids": req_ids,
            "new": [current[r] for r in new],
            "max_tokens": list(e.get("max_tokens", [])) if new else [],
            "source": e["source"] if machine else "",
            "state": e["state"] if machine else "",
            "sampled": [p is not None for p in e["positions"]] if materialize else [],
            "count": e["count"] if materialize else 0,
            "ok": bool(e["ok"]) if materialize else True,
            # the relay's row map, rows numbered as in the spec (1-based; 0: the row keeps its host id)
            "relay_from": [j + 1 for j in e.get("relay_from", [])][: len(req_ids)] if kind == "reinstate" else [],
            "inputs": [_input(row) for row in e.get("inputs", [])] if kind == "reinstate" else [],
            "counters": list(e.get("counters", [0, 0])) if kind == "reinstate" else [0, 0],
            "delivered": [by_name[r] for r in e.get("delivered", [])],
            "finished": [by_name[r] for r, _ in finished],
            "stopped": [by_name[r] for r, reason in finished if reason == "stop"],
            "req": current.get(e["req_id"], e["req_id"]) if kind == "Abort" else "",
        })  # fmt: skip
    return records


def sampled_values(events: list[dict], records: list[dict]) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Per request name its prompt length and the token values materialized for it, by output index
    (1-based; a gap holds -2, never a token). The trace spec compares CPU-built input ids with these."""
    prompt_lens: dict[str, int] = {}
    outputs: dict[str, dict[int, int]] = {}
    for e, r in zip(events, records, strict=True):
        if e["event"] == "step":
            prompt_lens.update(zip(r["new"], e.get("prompt_lens", []), strict=False))
        elif e["event"] == "Materialize" and e["ok"]:
            for name, position, token in zip(r["req_ids"], e["positions"], e.get("tokens", []), strict=False):
                if position is not None and name in prompt_lens:
                    outputs.setdefault(name, {}).setdefault(position - prompt_lens[name] + 1, token)
    values = {}
    for name, by_index in outputs.items():
        values[name] = [by_index.get(k, -2) for k in range(1, max(by_index) + 1)]
    return prompt_lens, values


def trace_log_module(events: list[dict]) -> str:
    """`TraceLog.tla`: the trace and the engine constants it ran with (its `config` header).

    Requests are listed in admission order (the step events' `new`), which is their arrival order:
    the scheduler admits FIFO. A request the trace never admits (aborted while waiting) is invisible
    and left out. Each request's output limit comes with its admission (`max_tokens`).
    """
    config = trace_config(events)
    threads = engine_threads(events)
    events = logged_events(events)
    records = trace_records(events, threads)
    prompt_lens, values = sampled_values(events, records)
    order: list[str] = []
    limits: dict[str, int] = {}
    admitted_at: dict[str, int] = {}  # request -> index of the step event admitting it
    next_step = [0] * (len(records) + 2)  # index -> index of the first step event at or after it
    for i, r in enumerate(records, start=1):
        if r["event"] == "step":
            order += r["new"]
            limits.update(zip(r["new"], r["max_tokens"], strict=True))
            admitted_at.update((req_id, i) for req_id in r["new"])
    following = 0
    for i in range(len(records), 0, -1):
        following = i if records[i - 1]["event"] == "step" else following
        next_step[i] = following
    chunks = config["max_model_len"]  # a bound only (a chunk has a token at least): the trace says when
    fn = "[r \\in {" + ", ".join(tla(r) for r in order) + "} |-> CASE " if order else None

    def function(values: Mapping[str, object], default: object = 0) -> str:
        if not order:
            return "<<>>"
        return fn + " [] ".join(f"r = {tla(r)} -> {tla(values.get(r, default))}" for r in order) + "]"

    lines = [
        "----------------------------- MODULE TraceLog -----------------------------",
        "\\* Generated by model_check/trace_check.py from an NDJSON trace. Do not edit.",
        "EXTENDS Integers, Sequences",
        f"TraceRequests == {tla(order)}",
        f"TraceReqSet == {{{', '.join(tla(r) for r in order)}}}",
        f"TraceMaxTokens == {function(limits)}",
        f"TracePromptLen == {function(prompt_lens)}",
        f"TraceOut == {function(values, [])}",  # per request: token values by output index
        f"TracePoison == {POISON_TOKEN}",
        f"TraceEngineThread == {tla(threads[0])}",
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
    return TraceVerdict(logged_events(events), matched, result)


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
