"""Trace validation of a speculative run: an NDJSON trace (`--trace` with `--speculative-config`) replayed
by TLC against `SpecDecode.tla`'s invariants (`TraceSpecDecode`).

A speculative step's tokens per row are many, which `AsyncScheduling.tla` does not model; this checks
what `SpecDecode.tla` is about: each row's first input is its request's last accepted token, every
accepted token reaches its client once and in order and never a rejected draft, nothing after a
stop, the placeholders are reconciled, no KV past `max_model_len`. Per step the trace gives the rows,
the drafts the scheduler reserved (`step` event), the draft ids verified and each row's input
(`reinstate`), each row's run (`Materialize`) and what each request got (`AdvanceStep`). A row's
accepted count is the run's longest prefix equal to its drafts (a recovered token never equals the
draft it replaces); tokens past the run's 1 + a are rejected drafts in the output, which
`AcceptedOnceInv` rejects. A row fed from a drafted future (draft_model's SpecSteady and SpecExit)
has no draft ids on the host (`proposed` null): its run's tokens before the last are the drafts it
accepted, and its input is the pending step's row of its own request (column 0: its last accepted
token). Requests admitted after the first step are the spec's `Late` ones.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from tlc import SPEC_DIR, run_tlc, tla
from trace_check import _MATCHED, TraceVerdict, read_trace, trace_config

TRACE_MODULE = "TraceSpecDecode"
SPEC_MODULES = ("SpecDecode.tla", "TraceSpecDecode.tla", "TraceSpecDecode.cfg")
# Events SpecDecode.tla has no action for: a trace with one is not checked (the machine's `step` is
# AsyncScheduling.tla's; a speculative step's Launch is its `reinstate`).
UNMODELLED = ("Abort", "drain", "launch", "mask")


def accepted(drafts: list[int] | None, run: list[int]) -> int:
    """How many of a row's drafts its run accepted: the longest prefix of the run equal to them (the
    run's last token is never a draft it accepted). Drafts that stayed on the device (None): the run
    is cut to its accepted ones on the device, so all but its last token."""
    if drafts is None:
        return len(run) - 1
    a = 0
    while a < min(len(drafts), len(run) - 1) and run[a] == drafts[a]:
        a += 1
    return a


def spec_records(events: list[dict]) -> tuple[list[dict], dict]:
    """The trace's events as SpecDecode records (Launch, Materialize, AdvanceStep), and the constants."""
    config = trace_config(events)
    if not config.get("async_scheduling") or "num_speculative_tokens" not in config:
        raise ValueError("not the trace of an async speculative run (the header has no num_speculative_tokens)")
    runs: dict[int, list[list[int]]] = {}  # step -> each row's run
    for e in events:
        if e["event"] == "Materialize":
            if not e["ok"]:
                raise ValueError(f"step {e['step']} failed: failures are not modelled by SpecDecode.tla")
            runs.setdefault(e["step"], e["runs"])
    requests: list[str] = []
    late: list[str] = []  # admitted after the first step
    admits: dict[int, list[str]] = {}  # step -> requests it admits
    prompt_lens: dict[str, int] = {}
    limits: dict[str, int] = {}
    drafts: dict[int, list[int]] = {}  # step -> drafts reserved per row
    out: dict[str, list[int]] = {}  # request -> its token values by output index (from 1)
    records = []
    blank = {"req_ids": [], "new": [], "drafts": [], "inputs": [], "acc": [], "extra": []}
    blank |= {"delivered": [], "counts": []}
    for e in events:
        kind = e["event"]
        if kind in UNMODELLED:
            raise ValueError(f"event {kind!r} (seq {e.get('seq')}): not modelled by SpecDecode.tla")
        if kind == "step":
            if requests:
                late += e["new"]
            requests += e["new"]
            admits[e["step"]] = e["new"]
            prompt_lens.update(zip(e["new"], e["prompt_lens"], strict=True))
            limits.update(zip(e["new"], e["max_tokens"], strict=True))
            drafts[e["step"]] = e["drafts"]
        elif kind == "reinstate":
            step, rows = e["step"], e["req_ids"]
            acc = [accepted(d, run) for d, run in zip(e["proposed"], runs[step], strict=True)]
            inputs = []
            for row in e["inputs"]:
                if row[0] not in ("prompt", "host", "future"):
                    raise ValueError(f"step {step}: input {row} (not a prompt, a host-built id or a future's row)")
                host, future = row[0] == "host", row[0] == "future"
                inputs.append(
                    {
                        "src": row[0],
                        "tok": row[1] if host else 0,
                        "pos": row[2] if host else 0,
                        "row": row[1] + 1 if future else 0,  # the pending step's row (1-based)
                        "col": row[2] if future and len(row) > 2 else 0,  # 0: its last accepted token
                    }
                )
            extra = [len(run) - 1 - a for run, a in zip(runs[step], acc, strict=True)]
            records.append(
                {**blank, "event": "Launch", "step": step, "req_ids": rows, "drafts": drafts[step], "inputs": inputs}
                | {"new": admits[step]}
                | {"acc": acc, "extra": extra}
            )
            for req_id, run, a in zip(rows, runs[step], acc, strict=True):
                out.setdefault(req_id, []).extend(run[: a + 1])  # its outputs: the accepted run
        elif kind == "Materialize":
            if e["count"] == 1:
                records.append({**blank, "event": "Materialize", "step": e["step"]})
        elif kind == "AdvanceStep":
            records.append(
                {**blank, "event": "AdvanceStep", "step": e["step"]}
                | {"delivered": e["delivered"], "counts": e["counts"], "finished": [r for r, _ in e["finished"]]}
            )
    for r in records:
        r.setdefault("finished", [])
    constants = {
        "requests": requests,
        "late": late,
        "k": config["num_speculative_tokens"],
        "max_tokens": limits,
        "room": {r: config["max_model_len"] - prompt_lens[r] for r in requests},
        "prompt_lens": prompt_lens,
        "out": out,
    }
    return records, constants


def trace_log_module(records: list[dict], constants: dict) -> str:
    """`SpecTraceLog.tla`: the records and the run's constants."""
    requests = constants["requests"]

    def function(values: dict) -> str:
        return "(" + " @@ ".join(f"{tla(r)} :> {tla(values[r])}" for r in requests) + ")"

    lines = [
        "---------------------------- MODULE SpecTraceLog ----------------------------",
        "\\* Generated by model_check/spec_trace_check.py from an NDJSON trace. Do not edit.",
        "EXTENDS Integers, Sequences, TLC",
        f"TraceRequests == {tla(requests)}",
        f"TraceReqSet == {tla(set(requests))}",
        f"TraceLate == {tla(set(constants['late']))}",
        f"TraceK == {constants['k']}",
        f"TraceMaxTokens == {function(constants['max_tokens'])}",
        f"TraceRoom == {function(constants['room'])}",
        f"TracePromptLen == {function(constants['prompt_lens'])}",
        f"TraceOut == {function({r: constants['out'].get(r, []) for r in requests})}",
        "TraceEvents == <<",
        ",\n".join("  " + tla(r) for r in records),
        ">>",
        "=============================================================================",
    ]
    return "\n".join(lines) + "\n"


def check_spec_trace(events: list[dict], *, timeout_s: float = 300) -> TraceVerdict:
    """Replay an async speculative run's trace against SpecDecode.tla with TLC; report how far it got."""
    records, constants = spec_records(events)
    with tempfile.TemporaryDirectory(prefix="spec-trace-check-") as scratch:
        work = Path(scratch)
        for name in SPEC_MODULES:
            shutil.copy(SPEC_DIR / name, work / name)
        (work / "SpecTraceLog.tla").write_text(trace_log_module(records, constants))
        result = run_tlc(
            TRACE_MODULE, f"{TRACE_MODULE}.cfg", spec_dir=work, extra=("-deadlock",), timeout_s=timeout_s, short=True
        )
    matched = max((int(m.group(1)) for line in result.printed if (m := _MATCHED.search(line))), default=0)
    return TraceVerdict(records, matched, result, 0, result.distinct_states or 0)


def main(argv: list[str] | None = None) -> int:
    """`python model_check/spec_trace_check.py TRACE.ndjson`: is a speculative run a behaviour of SpecDecode?"""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("trace", type=Path, help="an NDJSON trace of an async run with --speculative-config")
    verdict = check_spec_trace(read_trace(parser.parse_args(argv).trace))
    print(verdict.describe())
    return 0 if verdict.accepted else 1


if __name__ == "__main__":
    raise SystemExit(main())
