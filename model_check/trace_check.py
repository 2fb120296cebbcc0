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
# Structured output's: the machine's `launch` (a step with a masked row) and `mask` (its bitmask built).
LOGGED_EVENTS = ("step", "launch", "mask", "reinstate", "drain", "Materialize", "AdvanceStep", "Abort")
SPEC_INVARIANTS = ("TypeOK", "ExactlyOnceMaterializationInv", "TokenOwnershipInv", "NoStaleInputInv", "CounterInv")
POISON_TOKEN = -1  # neuron_async_sm.worker.input_batch.POISON_TOKEN: a token the host does not have yet
_MATCHED = re.compile(r'<<"matched", (\d+), (\d+)>>')
_CURSOR = re.compile(r"^/\\ l = (\d+)$", re.M)


@dataclass(frozen=True)
class TraceVerdict:
    """How far TLC could follow a trace, and the first event it could not take."""

    events: list[dict]  # the logged events the spec follows, as recorded (without the header)
    matched: int  # events matched, in order, from the start
    tlc: TlcResult  # the last TLC run (elapsed_s: all runs together)
    offset: int = 0  # index of the first event of that run's part
    distinct_states: int = 0  # over every part
    parts: int = 1  # TLC runs

    @property
    def accepted(self) -> bool:
        return self.tlc.exit_code == 0 and self.matched == len(self.events)

    @property
    def violated_invariant(self) -> str | None:
        """The spec's invariant the real run broke (TLC exit 12), or None. The trace module checks each
        one where the last event can have changed something (`RecentX`) and whole past the last event
        (`PastX`): both stand for the spec's `X`."""
        name = self.tlc.violated_invariant
        for part in ("Recent", "Past"):
            if name is not None and name.startswith(part) and name[len(part) :] in SPEC_INVARIANTS:
                return name[len(part) :]
        return name

    @property
    def violating_index(self) -> int | None:
        """0-based index of the event after which the invariant failed (the error trace's last cursor)."""
        if self.violated_invariant is None:
            return None
        cursors = [int(m.group(1)) for m in _CURSOR.finditer(self.tlc.output)]
        return self.offset + cursors[-1] - 2 if cursors else None

    @property
    def rejected_event(self) -> dict | None:
        if self.accepted:
            return None
        if self.violating_index is not None:
            return self.events[self.violating_index]
        return None if self.matched >= len(self.events) else self.events[self.matched]

    def describe(self) -> str:
        if self.accepted:
            return (
                f"accepted: {self.matched}/{len(self.events)} events in {self.tlc.elapsed_s:.1f}s "
                f"({self.parts} TLC run(s), {self.distinct_states} distinct states)"
            )
        if self.violated_invariant is not None:
            return (
                f"rejected: {self.violated_invariant} fails after event {self.violating_index} of "
                f"{len(self.events)} (0-based): {json.dumps(self.rejected_event)}"
            )
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


def stale_masks(events: Iterable[dict]) -> list[str]:
    """FreshMaskInv on a real trace: every masked row sampled its output k (0-based) under its grammar
    after exactly k tokens, never an older state. Returns one line per violation (empty: it holds)."""
    problems = []
    for e in events:
        if e["event"] == "mask":
            for req_id, grammar_tokens, output_index in e["masks"]:
                if grammar_tokens != output_index:
                    problems.append(
                        f"step {e['step']}: {req_id} sampled output {output_index} under its grammar after "
                        f"{grammar_tokens} tokens"
                    )
    return problems


def _input(row: list) -> dict:
    """One row's logged input as a record: prompt, a row of the pending future (1-based; of a drafted
    future, the column it reads: 0 the row's last accepted token, > 0 a draft), or host."""
    kind = row[0]
    return {
        "src": kind,
        "row": row[1] + 1 if kind == "future" else 0,
        "col": row[2] if kind == "future" and len(row) > 2 else 0,
        "tok": row[1] if kind == "host" else 0,
        "pos": row[2] if kind == "host" else 0,
    }


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
        if e["thread"] not in threads and e["event"] != "Abort":  # a client aborts between two steps
            raise ValueError(f"thread {e['thread']!r} is not the header's engine or output thread (seq {e.get('seq')})")
        kind = e["event"]
        materialize = kind == "Materialize"
        machine = kind in ("step", "launch", "reinstate", "drain")
        new = e.get("new", []) if kind == "step" else []
        for req_id in new:
            admissions[req_id] += 1
            current[req_id] = req_id if admissions[req_id] == 1 else f"{req_id}#{admissions[req_id]}"
        by_name: dict[str, str] = {}  # id -> name, in this event's step
        if kind in ("Materialize", "AdvanceStep", "mask"):
            req_ids = snapshot.get(e["step"], [current.get(r, r) for r in e.get("req_ids", [])])
            by_name = dict(zip(raw_ids.get(e["step"], []), req_ids, strict=False))
            if kind == "mask":  # names the requests of its masks only
                req_ids = []
        elif machine:
            req_ids = [current.get(r, r) for r in e["req_ids"]]
            if kind == "step":
                snapshot[e["step"]], raw_ids[e["step"]] = req_ids, e["req_ids"]
        else:
            req_ids = []
        finished = e.get("finished", []) if kind == "AdvanceStep" else []
        records.append(
            {
                "event": kind,
                "step": e.get("step", -1),
                "thread": e["thread"],
                "req_ids": req_ids,
                "new": [current[r] for r in new],
                "max_tokens": list(e.get("max_tokens", [])) if new else [],
                "source": e["source"] if machine else "",
                "drafts": list(e.get("drafts", [])) if kind == "step" else [],  # per row, reserved (speculation)
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
                # structured output: a launch's masked rows; a mask's rows (the grammar state it came
                # from: tokens its grammar had taken, and the output index the row samples, 0-based)
                "masked": [current.get(r, r) for r in e.get("masked", [])] if kind == "launch" else [],
                "masks": [{"req": by_name[r], "grammar": g, "index": k} for r, g, k in e["masks"]]
                if kind == "mask"
                else [],
            }
        )
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


def device_drafter(events: list[dict]) -> bool:
    """A speculative run whose drafter runs on the device (draft_model): its steps never take
    HostDraftBreak, n-gram's row (whose runs are SpecDecode.tla's to check: spec_trace_check.py)."""
    config = trace_config(events)
    if "num_speculative_tokens" not in config:
        return False
    if any(e["event"] == "step" and e["state"] == "HostDraftBreak" for e in events):
        raise ValueError("the trace of a speculative run: check it with model_check/spec_trace_check.py")
    return True


def drafted_values(
    events: list[dict], records: list[dict]
) -> tuple[dict[str, int], dict[str, list[int]], dict[str, list[int]], dict[str, int]]:
    """A device drafter's run, as the spec sees it: each row gives one abstract token (Tok(r, k) is
    r's k-th row), the real ones its run of 1 + a. Per request its prompt length, its real token
    values by output index (its rows' runs in order), the real output index of the last accepted
    token each row k computes on (its run's start: a CPU-built id must be that token, at that
    position), and its rows (the spec's max_tokens: the last one ends the request, or a stop before)."""
    prompt_lens: dict[str, int] = {}
    runs: dict[str, list[list[int]]] = {}
    for e, r in zip(events, records, strict=True):
        if e["event"] == "step":
            prompt_lens.update(zip(r["new"], e.get("prompt_lens", []), strict=False))
        elif e["event"] == "Materialize" and e["ok"] and e["count"] == 1:
            for name, position, run in zip(r["req_ids"], e["positions"], e["runs"], strict=True):
                if position is not None:
                    runs.setdefault(name, []).append(list(run))
    values = {name: [t for run in rs for t in run] for name, rs in runs.items()}
    starts = {name: [sum(len(run) for run in rs[:k]) for k in range(len(rs))] for name, rs in runs.items()}
    return prompt_lens, values, starts, {name: len(rs) for name, rs in runs.items()}


PART_EVENTS = 750  # events per TLC run: a longer trace is checked in parts, each from its predecessor's end
DEPTH = 2  # the spec's Depth: a part keeps the last Depth + 1 steps, and any older step still in flight


@dataclass(frozen=True)
class Trace:
    """A trace as the spec sees it: its logged events as records, and the facts every part shares."""

    config: dict
    threads: tuple[str, str]
    events: list[dict]  # logged_events(), as recorded
    records: list[dict]  # trace_records(), one per event
    limits: dict[str, int]  # request name -> max_tokens (a device drafter's run: its rows)
    prompt_lens: dict[str, int]
    values: dict[str, list[int]]  # request name -> token values by output index
    ids: dict[str, str]  # request name -> the id the engine gave it (reused ids: "id#2" -> "id")
    drafter: bool = False  # a device drafter's run (draft_model): one abstract token per row
    run_starts: dict[str, list[int]] | None = None  # device drafter: per row, its run's real output index

    @classmethod
    def of(cls, raw: list[dict]) -> Trace:
        config, threads = trace_config(raw), engine_threads(raw)
        events = logged_events(raw)
        records = trace_records(events, threads)
        ids = {
            name: req_id
            for e, r in zip(events, records, strict=True)
            if e["event"] == "step"
            for name, req_id in zip(r["new"], e["new"], strict=True)
        }
        if device_drafter(raw):
            prompt_lens, values, starts, limits = drafted_values(events, records)
            return cls(config, threads, events, records, limits, prompt_lens, values, ids, True, starts)
        prompt_lens, values = sampled_values(events, records)
        limits: dict[str, int] = {}
        for r in records:
            limits.update(zip(r["new"], r["max_tokens"], strict=True))
        return cls(config, threads, events, records, limits, prompt_lens, values, ids)


def combine(pairs: list[str]) -> str:
    """`k :> v` terms joined by `@@` as a balanced tree: TLC evaluates `@@` recursively, and a flat chain
    of a few hundred requests overflows its stack (a tree of them is log2(n) deep)."""
    if len(pairs) == 1:
        return f"({pairs[0]})"
    half = len(pairs) // 2
    return f"({combine(pairs[:half])} @@ {combine(pairs[half:])})"


def trace_log_module(
    trace: Trace,
    start: int = 0,
    stop: int | None = None,
    *,
    carried: Iterable[str] = (),
    start_states: list[str] | None = None,
    offsets: tuple[int, int, int] = (0, 0, 0),
) -> str:
    """`TraceLog.tla` for the events `start:stop` of a trace and the engine constants it ran with.

    Requests are listed in admission order (the step events' `new`), which is their arrival order:
    the scheduler admits FIFO. A request the trace never admits (aborted while waiting) is invisible
    and left out. Each request's output limit comes with its admission (`max_tokens`). A part after
    the first starts from `start_states` (TLA+ records of every variable, from the previous part's
    end, see `compact`), knows only the requests `carried` over and those it admits, and numbers
    steps and counters from `offsets` (steps, async and sync steps left out before it).
    """
    stop = len(trace.records) if stop is None else stop
    config, threads = trace.config, trace.threads
    steps_off, async_off, sync_off = offsets
    records = []
    for r in trace.records[start:stop]:
        r = dict(r, step=r["step"] - steps_off if r["step"] >= 0 else r["step"])
        if r["event"] == "reinstate":
            r["counters"] = [r["counters"][0] - async_off, r["counters"][1] - sync_off]
        records.append(r)
    order = list(carried)
    admitted_at: dict[str, int] = {}  # request -> index of the step event admitting it
    next_step = [0] * (len(records) + 2)  # index -> index of the first step event at or after it
    for i, r in enumerate(records, start=1):
        if r["event"] == "step":
            order += r["new"]
            admitted_at.update((req_id, i) for req_id in r["new"])
    following = 0
    for i in range(len(records), 0, -1):
        following = i if records[i - 1]["event"] == "step" else following
        next_step[i] = following
    chunks = config["max_model_len"]  # a bound only (a chunk has a token at least): the trace says when

    def function(values: Mapping[str, object], default: object = 0) -> str:
        """A function on the part's requests, built by TLC as a table (`:>`, `@@`), not re-evaluated."""
        if not order:
            return "<<>>"
        return combine([f"{tla(r)} :> {tla(values.get(r, default))}" for r in order])

    lines = [
        "----------------------------- MODULE TraceLog -----------------------------",
        "\\* Generated by model_check/trace_check.py from an NDJSON trace. Do not edit.",
        "EXTENDS Integers, Sequences, TLC",
        f"TraceRequests == {tla(order)}",
        f"TraceReqSet == {{{', '.join(tla(r) for r in order)}}}",
        f"TraceIds == {function(trace.ids)}",  # the id each request had: a reused id's later ones are "id#2"
        f"TraceMaxTokens == {function(trace.limits)}",
        f"TracePromptLen == {function(trace.prompt_lens)}",
        f"TraceOut == {function(trace.values, [])}",  # per request: token values by output index
        f"TraceDeviceDrafter == {tla(trace.drafter)}",
        f"TraceRunStart == {function(trace.run_starts or {}, [])}",  # device drafter: per row k, its run's start
        f"TraceNumSpecTokens == {trace.config.get('num_speculative_tokens', 0)}",  # k (0: no speculation)
        f"TracePoison == {POISON_TOKEN}",
        f"TraceEngineThread == {tla(threads[0])}",
        f"TraceAdmittedAt == {function(admitted_at)}",
        # the requests that sample under a grammar (every step they sample in launches with them masked)
        f"TraceConstrained == {tla({r for rec in trace.records for r in rec['masked']})}",
        f"TraceNextStep == {tla(next_step[1:])}",  # indexed 1..Len(TraceEvents) + 1
        f"TraceMaxSeqs == {config['max_num_seqs']}",
        f"TraceBuckets == {tla(set(config['decode_buckets']))}",
        f"TraceMaxChunks == {chunks}",
        # Programs may fail only in a trace that shows a failure: an error or a drained engine.
        f"TraceAllowFailure == {tla(any(r['event'] == 'drain' or not r['ok'] for r in trace.records))}",
        f"TraceAsyncRelay == {tla(bool(config.get('async_relay', False)))}",  # traces from before the relay: off
        f"TraceEngineCore == {tla(config.get('engine_core', 'ours'))}",  # "vllm": the plugin under vLLM's engine
        # vLLM's uni-process executor: the engine thread itself calls get_output() in order
        f"TraceOutputOnEngineThread == {tla(threads[0] == threads[1])}",
        f"TracePrintEnd == {tla(stop < len(trace.records))}",  # a part with a successor prints its end states
        "TraceStart == {" + ",\n  ".join(start_states or []) + "}",
        "TraceEvents == <<",
        ",\n".join("  " + tla(r) for r in records),
        ">>",
        "=============================================================================",
    ]
    return "\n".join(lines) + "\n"


# --- TLC's printed values, read back: the states one part ends in, for the next to start from --------


class Record(dict):
    """A TLA+ record as TLC prints it: `[field |-> value, ...]`."""


class Function(dict):
    """A TLA+ function on strings as TLC prints it: `("a" :> 1 @@ "b" :> 2)`."""


class TlaSet(list):
    """A TLA+ set, elements in TLC's order."""


_TOKEN = re.compile(r'\s*(<<|>>|\|->|:>|@@|[\[\](){},]|"(?:[^"\\]|\\.)*"|-?\d+|TRUE|FALSE|[A-Za-z_][\w]*)')


def parse_value(text: str) -> object:
    """A value in TLC's output syntax (records, functions, sequences, sets, strings, integers, booleans)."""
    tokens, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            if text[pos:].strip():
                raise ValueError(f"cannot read TLC value at {text[pos : pos + 40]!r}")
            break
        tokens.append(m.group(1))
        pos = m.end()
    at = 0

    def take() -> str:
        nonlocal at
        at += 1
        return tokens[at - 1]

    def items(close: str) -> list:
        out = []
        while tokens[at] != close:
            out.append(value())
            if tokens[at] == ",":
                take()
        take()
        return out

    def value() -> object:
        t = take()
        if t == "<<":
            return items(">>")
        if t == "{":
            return TlaSet(items("}"))
        if t == "[":
            rec = Record()
            while tokens[at] != "]":
                field = take()
                assert take() == "|->"
                rec[field] = value()
                if tokens[at] == ",":
                    take()
            take()
            return rec
        if t == "(":
            fcn = Function()
            while True:
                key = value()
                assert take() == ":>"
                fcn[key] = value()
                if take() == ")":
                    return fcn
        if t.startswith('"'):
            return json.loads(t)
        if t in ("TRUE", "FALSE"):
            return t == "TRUE"
        return int(t)

    return value()


def emit(value: object) -> str:
    """`parse_value`'s result as TLA+ again."""
    if isinstance(value, Record):
        return "[" + ", ".join(f"{k} |-> {emit(v)}" for k, v in value.items()) + "]"
    if isinstance(value, Function):
        return combine([f"{emit(k)} :> {emit(v)}" for k, v in value.items()]) if value else "<<>>"
    if isinstance(value, TlaSet):
        return "{" + ", ".join(emit(v) for v in value) + "}"
    if isinstance(value, list):
        return "<<" + ", ".join(emit(v) for v in value) + ">>"
    return tla(value)


def end_states(printed: list[str]) -> list[Record]:
    """The distinct states a part ended in (`<<"end", [...]>>`, printed by TLC over several lines)."""
    text = "\n".join(printed)
    states, seen = [], set()
    for m in re.finditer(r'<<\s*"end",', text):
        depth, i = 1, m.end()
        while depth:  # the matching >>, outside strings
            if text.startswith('"', i):
                i = text.index('"', i + 1) + 1
                continue
            if text.startswith("<<", i):
                depth, i = depth + 1, i + 2
            elif text.startswith(">>", i):
                depth, i = depth - 1, i + 2
            else:
                i += 1
        body = re.sub(r"\s+", " ", text[m.end() : i - 2])
        if body not in seen:
            seen.add(body)
            states.append(parse_value(body))
    return states


def compact(states: list[Record]) -> tuple[list[Record], list[str], tuple[int, int, int]]:
    """The states with the history no action reads again left out, as a next part starts from them.

    Steps before the oldest one still pending, queued, unrun or among the last Depth + 1 are dropped
    and the rest renumbered; their paths leave the counters (`numAsync`, `numSync`, the engine's and
    the counted ones alike), so CounterInv and EngineCountersInv read the same. A finished request
    that no kept step, row, plan or finished set names is dropped: no action reads it again. Returns
    the states, the requests kept (arrival order) and (steps, async, sync) left out.
    """
    first = states[0]
    lo = len(first["steps"]) - DEPTH
    for st in states:
        held = [st["pending"] or len(st["steps"]) + 1, *st["batchQueue"], *st["outQueue"], st["ran"] + 1]
        lo = max(1, min(lo, *held))
    dropped = [st["steps"][: lo - 1] for st in states]
    paths = [step["path"] for step in dropped[0]]
    if any([step["path"] for step in d] != paths for d in dropped):
        raise ValueError("the parts' end states disagree on a step's path")  # the trace pins every path
    n_async = sum(path in ("Steady", "Relay", "SpecSteady", "SpecExit") for path in paths)  # AsyncStates
    offsets = (lo - 1, n_async, len(paths) - n_async)

    def named(st: Record) -> set[str]:
        names = set(st["rows"]) | set(st["finishedIds"])
        for step in st["steps"][lo - 1 :]:
            names |= set(step["rows"])
        if st["cur"]["path"] != "":
            names |= set(st["cur"]["curr"]) | set(st["cur"]["order"]) | set(st["cur"]["scheduled"])
        return names

    keep = [r for r in first["status"] if any(st["status"][r] != "finished" or r in named(st) for st in states)]
    order = [r for r in first["status"] if r in keep]  # Function keys keep TLC's order: sorted, not arrival
    out = []
    for st in states:
        st = Record(st)
        st["steps"] = st["steps"][lo - 1 :]
        st["pending"] = st["pending"] - (lo - 1) if st["pending"] else 0
        st["batchQueue"] = [s - (lo - 1) for s in st["batchQueue"]]
        st["outQueue"] = [s - (lo - 1) for s in st["outQueue"]]
        st["ran"] -= lo - 1
        st["arrived"] -= len(first["status"]) - len(keep)
        for name in ("numAsync", "numSync"):
            st[name] -= offsets[1] if name == "numAsync" else offsets[2]
        st["engineCounts"] = [st["engineCounts"][0] - offsets[1], st["engineCounts"][1] - offsets[2]]
        st["pathCounts"] = [st["pathCounts"][0] - offsets[1], st["pathCounts"][1] - offsets[2]]
        for name in ("status", "phase", "chunks", "placeholders", "delivered", "stopLen", "host"):
            st[name] = Function((r, st[name][r]) for r in order)
        out.append(st)
    return out, order, offsets


def arrive(state: Record, names: list[str], limits: Mapping[str, int]) -> Record:
    """`state` with `names` added as requests that have not arrived (as the spec's Init has them)."""
    state = Record(state)
    fresh = {"status": "absent", "phase": "prefill", "chunks": 0, "placeholders": 0, "delivered": [], "host": []}
    for var, value in [*fresh.items(), ("stopLen", None)]:
        state[var] = Function(state[var])
        for name in names:
            state[var][name] = limits[name] if var == "stopLen" else value
    return state


def traced_machine_run(stateful, machine: type, examples: int, steps: int, trace_dir: Path) -> list[Path]:
    """Run a hypothesis state machine of tests/test_stateful_engine.py (`stateful`, the module) for
    `examples` derandomized examples of `steps` steps, every engine writing its trace into trace_dir;
    the traces written, sorted. Engines an earlier test of the session left are discarded first (they
    write no trace) and this run's after it."""
    from hypothesis import HealthCheck, settings  # noqa: PLC0415  # hypothesis: only the traced runs
    from hypothesis.stateful import run_state_machine_as_test  # noqa: PLC0415

    for device in list(stateful._ENGINES):
        stateful._discard_engine(device)
    stateful.TRACE_DIR = str(trace_dir)
    try:
        run_state_machine_as_test(
            machine,
            settings=settings(
                max_examples=examples,
                stateful_step_count=steps,
                derandomize=True,
                database=None,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    finally:
        stateful.TRACE_DIR = None
        for device in list(stateful._ENGINES):
            stateful._discard_engine(device)
    return sorted(Path(trace_dir).glob("*.ndjson"))


def check_trace(events: list[dict], *, timeout_s: float = 300, part_events: int = PART_EVENTS) -> TraceVerdict:
    """Replay an async engine's trace against the spec with TLC; report how far it got.

    A trace longer than `part_events` is checked in parts, one TLC run each, every part from the
    states its predecessor ended in: each run's state then stays as small as the part, not the
    trace so far (the time is linear in the trace's length).
    """
    trace = Trace.of(events)  # n-gram's runs are refused: SpecDecode.tla's concern
    order_of = {name: i for i, name in enumerate(r for rec in trace.records for r in rec["new"])}
    start, carried, states, offsets = 0, [], None, (0, 0, 0)
    elapsed, distinct = 0.0, 0
    while True:
        stop = min(len(trace.records), start + part_events)
        if states is not None:  # the part's own requests have not arrived yet: the spec's Init for them
            arriving = [name for r in trace.records[start:stop] for name in r["new"]]
            states = [arrive(st, arriving, trace.limits) for st in states]
        module = trace_log_module(
            trace,
            start,
            stop,
            carried=carried,
            offsets=offsets,
            start_states=None if states is None else [emit(st) for st in states],
        )
        with tempfile.TemporaryDirectory(prefix="trace-check-") as scratch:
            work = Path(scratch)
            for name in SPEC_MODULES:
                shutil.copy(SPEC_DIR / name, work / name)
            (work / "TraceLog.tla").write_text(module)
            result = run_tlc(
                TRACE_MODULE,
                f"{TRACE_MODULE}.cfg",
                spec_dir=work,
                extra=("-deadlock",),
                timeout_s=timeout_s,
                short=True,
            )
        elapsed += result.elapsed_s
        distinct += result.distinct_states or 0
        matched = 0
        for line in result.printed:
            if m := _MATCHED.search(line):
                matched = max(matched, int(m.group(1)))
        if result.exit_code != 0 or matched < stop - start or stop == len(trace.records):
            result.elapsed_s = elapsed
            return TraceVerdict(trace.events, start + matched, result, start, distinct, 1 + start // part_events)
        states, carried, more = compact(end_states(result.printed))
        carried = sorted(carried, key=order_of.__getitem__)  # arrival order, as the scheduler admits
        offsets = tuple(a + b for a, b in zip(offsets, more, strict=True))
        start = stop


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
