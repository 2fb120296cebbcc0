"""`neuron-async-sm bench`: argument parsing, the sections to run, tables on stdout, JSON and plots.

Sections: the sync/async comparison on one workload (always, unless `--no-compare`; with
`--speculative-config`, on four engines: sync and async, each without and with speculation), and on
request the D/C sweep (`--sweep`), host cost per step vs batch size and vs waiting requests
(`--host-cost`), and tokens/s against transformers (`--vs-transformers`). `--all` runs every section.
`bench serve` (bench/serve_command.py) benchmarks an HTTP server instead of the engine in process;
`bench spec-checkpoints DIR` writes the speculative-decoding benchmark's target and drafts.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import time
from pathlib import Path

from neuron_async_sm.args import add_engine_flag, positive_floats
from neuron_async_sm.bench import host_cost, peer, sweep
from neuron_async_sm.bench.checkpoint import SPEC_K, write_spec_checkpoints
from neuron_async_sm.bench.report import finite, machine, progress_bar
from neuron_async_sm.bench.runner import batch_config, compare_modes, load_average
from neuron_async_sm.bench.serve_command import add_serve_bench_parser
from neuron_async_sm.bench.workloads import DEFAULT_NUM_REQUESTS, WORKLOADS, build_workload, with_constraints
from neuron_async_sm.config import ConfigError, SpeculativeConfig
from neuron_async_sm.model.config import load_model_config
from neuron_async_sm.runtime.devices import DeviceKind

DEVICES = tuple(kind.value for kind in DeviceKind)

COMPARE_FIELDS = (
    ("tokens/s", "tokens_per_s", "{:.0f}"),
    ("steps/s", "steps_per_s", "{:.0f}"),
    ("ms/step", "step_ms", "{:.3f}"),
    ("C host ms/step", "host_ms_per_step", "{:.3f}"),
    ("D device ms/step", "device_ms_per_step", "{:.3f}"),
    ("device idle ms/step", "device_idle_ms_per_step", "{:.3f}"),
    ("device overhead ms", "device_overhead_ms_per_step", "{:.3f}"),
    ("TTFT p50 ms", "ttft_ms_p50", "{:.1f}"),
    ("TPOT p50 ms", "tpot_ms_p50", "{:.3f}"),
    ("TPOT p99 ms", "tpot_ms_p99", "{:.3f}"),
    ("ITL p99 ms", "itl_ms_p99", "{:.3f}"),
)


SPEC_FIELDS = (COMPARE_FIELDS[0], ("tokens/step", "tokens_per_step", "{:.2f}"), *COMPARE_FIELDS[1:])


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from exc
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _device_cpu(text: str) -> int | None:
    if text == "none":
        return None
    if text == "auto":
        cpus = os.cpu_count() or 1
        return cpus - 1 if cpus >= 2 else None
    try:
        return int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected 'auto', 'none' or a CPU number, got {text!r}") from exc


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark async against sync, the overlap limit and transformers")
    p.add_argument("--workload", default="steady", choices=WORKLOADS, help="see neuron_async_sm/bench/workloads.py")
    p.add_argument("--num-requests", type=int, default=None, help="default: steady 8, churn 64, mixed 48")
    p.add_argument("--output-tokens", type=int, default=None, help="steady: output tokens per request (256)")
    p.add_argument(
        "--penalties", action="store_true", help="every request with presence/frequency/repetition penalties"
    )
    p.add_argument(
        "--constrained-fraction",
        type=float,
        default=0.0,
        metavar="F",
        help="this share of the requests under a grammar (a JSON schema, a regex, a choice; the model "
        "needs a tokenizer.json that can spell them)",
    )
    p.add_argument("--repetitions", type=int, default=5, help="recorded runs per mode (alternating)")
    p.add_argument("--warmup", type=int, default=1, help="unrecorded runs per mode first")
    p.add_argument("--model", default="tiny-llama")
    p.add_argument(
        "--device",
        default="cpu",
        choices=DEVICES,
        help="backend of the sync/async comparison (xla: run from the XLA venv, .ci/xla-env)",
    )
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: steady N requests, others 8")
    p.add_argument("--device-time-ms", type=float, default=0.0, help="hold each program this long (0: real compute)")
    p.add_argument("--device-threads", type=int, default=1, help="torch threads inside the device process")
    p.add_argument(
        "--device-cpu",
        default="auto",
        type=_device_cpu,
        help="CPU the device owns: auto (the last CPU), none (no pinning) or a number; cpu: the device "
        "process, xla: PJRT's native threads (Python's threads get the other CPUs)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logprobs", type=int, default=None, metavar="N", help="every request asks for N logprobs")
    p.add_argument(
        "--async-relay",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the async engine relays the sampled-token future across batch changes",
    )
    p.add_argument(
        "--max-other-cpu",
        type=float,
        default=None,
        metavar="SHARE",
        help="shared machine: redo a sync/async pair if other processes used more than this share "
        "of the CPUs during it (e.g. 0.1)",
    )
    # The engine flag itself (parsed by SpeculativeConfig.parse): the comparison adds two engines with it.
    add_engine_flag(p, "speculative_config")
    p.add_argument("--no-compare", action="store_true", help="skip the sync/async comparison")
    p.add_argument(
        "--sweep",
        nargs="?",
        const=sweep.DEFAULT_RATIOS,
        type=positive_floats,
        default=None,
        metavar="RATIOS",
        help="D/C sweep at these ratios (default 0.25,0.5,1,2,4)",
    )
    p.add_argument(
        "--sweep-batch",
        type=_positive_int,
        default=sweep.SWEEP_BATCH,
        metavar="N",
        help=f"the sweep's steady batch (default {sweep.SWEEP_BATCH}); the real-compute point's D/C moves with it",
    )
    p.add_argument("--host-cost", action="store_true", help="C per step vs batch size and vs waiting requests")
    p.add_argument("--vs-transformers", action="store_true", help="tokens/s against transformers generate()")
    p.add_argument("--all", action="store_true", help="every section")
    p.add_argument("--json", default=None, metavar="FILE", help="write the report as JSON")
    p.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run_bench)
    sections = p.add_subparsers(dest="bench_command", metavar="{serve,spec-checkpoints}", title="more")
    add_serve_bench_parser(sections)  # bench/serve_command.py: `bench serve`
    pair = sections.add_parser(
        "spec-checkpoints",
        help="write the speculative-decoding benchmark's checkpoints: a target, a high- and a low-acceptance draft",
    )
    pair.add_argument("directory", help="written into DIRECTORY/target, DIRECTORY/draft-high, DIRECTORY/draft-low")
    pair.set_defaults(func=run_spec_checkpoints)


def run_spec_checkpoints(args: argparse.Namespace) -> int:
    """`bench spec-checkpoints DIR`: write the pair, print the bench command of each setting."""
    paths = write_spec_checkpoints(args.directory)
    for setting in ("high", "low"):
        spec = {"method": "draft_model", "model": str(paths[f"draft-{setting}"]), "num_speculative_tokens": SPEC_K}
        print(f"{setting}: neuron-async-sm bench --model {paths['target']} --speculative-config '{json.dumps(spec)}'")
    return 0


def _require_dev_extras(args: argparse.Namespace) -> None:
    """Sections that need the dev extras fail here, before any run, not after minutes of benchmarking."""
    needed = {"transformers": "--vs-transformers", "matplotlib": "--plots"}
    wanted = {"transformers": args.vs_transformers, "matplotlib": args.plots}
    missing = [module for module, want in wanted.items() if want and importlib.util.find_spec(module) is None]
    if missing:
        flags = ", ".join(f"{needed[m]} needs {m}" for m in missing)
        raise ConfigError(f"{flags} (the dev extras: pip install -e '.[dev]'); nothing ran")


def run_bench(args: argparse.Namespace) -> int:
    if args.all:
        args.sweep = args.sweep or sweep.DEFAULT_RATIOS
        args.host_cost = args.vs_transformers = True
    _require_dev_extras(args)
    if args.speculative_config is not None:
        args.speculative_config = SpeculativeConfig.parse(args.speculative_config)  # ConfigError names the key
        if args.no_compare:
            raise ConfigError("--speculative-config: speculates in the comparison, which --no-compare skips")
    show = not args.no_progress
    engine = {"device_cpu": args.device_cpu, "device_threads": args.device_threads}
    report: dict = {"machine": machine(), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "engine_options": engine}
    if not args.no_compare:
        report.update(_compare_section(args, show))
    if args.sweep:
        advance, close = progress_bar(show, 1 + 2 * (args.repetitions + 1) * (len(args.sweep) + 1), "sweep D/C")
        report["sweep"] = sweep.run_sweep(
            args.sweep,
            batch=args.sweep_batch,
            repetitions=args.repetitions,
            progress=advance,
            engine_options=engine,
            max_other_cpu=args.max_other_cpu,
        )
        close()
        _print_sweep(report["sweep"])
    if args.host_cost:
        advance, close = progress_bar(show, args.repetitions + 3, "host cost")  # rounds: batch, then waiting
        quiet = args.max_other_cpu
        report["host_cost_batch"] = host_cost.host_cost_vs_batch(
            progress=advance, engine_options=engine, repetitions=args.repetitions, max_other_cpu=quiet
        )
        report["host_cost_waiting"] = host_cost.host_cost_vs_waiting(
            progress=advance, engine_options=engine, max_other_cpu=quiet
        )
        close()
        _print_rows("C per step vs batch size (µs)", report["host_cost_batch"]["rows"], "batch")
        for mode, fit in report["host_cost_batch"]["linear_fit"].items():
            print(
                f"{mode}: C = {fit['intercept_us']:.0f} µs + {fit['slope_us_per_request']:.1f} µs x batch "
                f"(worst point {fit['max_relative_residual']:.0%} off the line)"
            )
        _print_rows("C per step vs waiting requests (µs)", report["host_cost_waiting"]["rows"], "waiting")
    if args.vs_transformers:
        advance, close = progress_bar(show, len(peer.DEFAULT_PEER_BATCHES), "vs transformers")
        report["vs_transformers"] = peer.vs_transformers(
            progress=advance, engine_options=engine, repetitions=args.repetitions, max_other_cpu=args.max_other_cpu
        )
        close()
        _print_peer(report["vs_transformers"])
        cb = peer.vs_transformers_continuous(engine_options=engine, repetitions=args.repetitions)
        report["vs_transformers_continuous"] = cb
        ours = cb["tokens_per_s"]["ours"]
        print(f"mixed vs transformers' continuous batching: ours {ours:.0f} tok/s, ratio {cb['ratio']:.2f}")
    report["machine"]["load_avg_end"] = load_average()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(finite(report), indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    if args.plots:
        from neuron_async_sm.bench.plots import write_plots

        for path in write_plots(report, args.plots):
            print(f"wrote {path}")
    return 0


def _compare_section(args: argparse.Namespace, show: bool) -> dict:
    num_requests = args.num_requests or DEFAULT_NUM_REQUESTS[args.workload]
    max_num_seqs = args.max_num_seqs or (num_requests if args.workload == "steady" else 8)
    vocab_size = load_model_config(args.model).vocab_size  # prompts must fit the model's vocabulary
    workload = build_workload(
        args.workload,
        num_requests=num_requests,
        output_tokens=args.output_tokens,
        seed=args.seed,
        vocab_size=vocab_size,
        penalties=args.penalties,
    ).with_logprobs(args.logprobs)
    workload = with_constraints(workload, args.constrained_fraction)
    emulated = args.device == "cpu"  # the device process: pinning and its torch threads apply
    # xla (PJRT's CPU client here) computes in this process: its native threads get the device's CPU
    # (measured: docs/backends.md, "Where the CPU client computes"); a real accelerator needs no pinning.
    native_cpu = args.device_cpu if args.device == "xla" else None
    config = {
        **batch_config(max_num_seqs),
        "device": args.device,
        "device_time_ms": args.device_time_ms,
        "device_threads": args.device_threads if emulated else 1,
        "device_cpu": args.device_cpu if emulated else None,
        "seed": args.seed,
        "async_relay": args.async_relay,
    }
    speculative = args.speculative_config
    engines = 2 if speculative is None else 4
    advance, close = progress_bar(show, engines * (args.warmup + args.repetitions), f"bench {args.workload}")
    try:
        result = compare_modes(
            args.model,
            workload,
            repetitions=args.repetitions,
            warmup=args.warmup,
            max_other_cpu=args.max_other_cpu,
            native_cpu=native_cpu,
            progress=advance,
            speculative_config=speculative,
            **config,
        )
    finally:
        close()
    section = result.to_json()
    section.update(workload=args.workload, num_requests=num_requests, model=args.model, config=config)
    section["speculative_config"] = None if speculative is None else dataclasses.asdict(speculative)
    section["penalties"] = args.penalties
    section["constrained_fraction"] = args.constrained_fraction
    section["native_cpu"] = native_cpu
    _print_compare(section)
    if speculative is not None:
        _print_speculation(section)
    return section


def _print_compare(section: dict) -> None:
    config, reps = section["config"], section["sync"]["repetitions"]
    print(
        f"\n{section['workload']}: {section['num_requests']} requests, {section['model']}, "
        f"--device {config['device']}, "
        f"device_time_ms={config['device_time_ms']}, medians of {reps} runs per mode"
    )
    _print_table([("sync", section["sync"]), ("async", section["async"])], COMPARE_FIELDS)
    print(
        f"speedup {section['speedup']:.3f} (ideal {section['ideal_speedup']:.3f}), "
        f"overlap_efficiency {section['overlap_efficiency']:.2f}, D/C {section['D_over_C']:.2f}, "
        f"async_step_fraction {section['async_step_fraction']:.3f}"
    )
    bound, efficiency = section["ideal_speedup_with_transport"], section["overlap_efficiency_with_transport"]
    print(
        f"with the transport O = {section['O_ms']:.3f} ms/step counted as host time: ideal {bound:.3f}, "
        f"efficiency {efficiency:.2f}"
    )
    print(
        f"state_counts {section['state_counts']}; pairs redone because the machine was busy: "
        f"{section['excluded_pairs']}"
    )
    if section["constrained_fraction"]:
        print(
            f"constrained fraction {section['constrained_fraction']}: launch_counts {section['launch_counts']}, "
            f"deferred_step_fraction {section['deferred_step_fraction']:.3f}"
        )


def _print_table(columns: list[tuple[str, dict]], fields: tuple[tuple[str, str, str], ...]) -> None:
    print(f"{'':20s}" + "".join(f" {name:>10s}" for name, _ in columns))
    for label, key, fmt in fields:
        print(f"{label:20s}" + "".join(f" {fmt.format(metrics[key]):>10s}" for _, metrics in columns))


def _print_speculation(section: dict) -> None:
    spec, config = section["speculation"], section["speculative_config"]
    print(
        f"\nwith speculation ({config['method']}, k = {config['num_speculative_tokens']}): "
        f"medians of {spec['sync']['repetitions']} runs per engine, each repetition runs all four"
    )
    columns = [("sync", section["sync"]), ("async", section["async"])]
    _print_table(columns + [("sync spec", spec["sync"]), ("async spec", spec["async"])], SPEC_FIELDS)
    for mode in ("sync", "async"):
        ratio, per_step = spec["spec_over_none"][mode], spec["tokens_per_step"][mode]
        print(
            f"{mode}: spec/none tokens/s {ratio['median']:.3f} (paired, {ratio['min']:.3f}-{ratio['max']:.3f}); "
            f"acceptance {spec['acceptance_rate'][mode]:.3f}, tokens per spec row "
            f"{spec['tokens_per_spec_row'][mode]:.2f}, tokens per target step {per_step['none']:.2f} -> "
            f"{per_step['spec']:.2f}"
        )
    print(
        f"async/sync with speculation: speedup {spec['speedup']:.3f} (ideal {spec['ideal_speedup']:.3f}, with the "
        f"transport {spec['ideal_speedup_with_transport']:.3f}), overlap_efficiency {spec['overlap_efficiency']:.2f}, "
        f"D/C {spec['D_over_C']:.2f}"
    )
    counts = {k: n for k, n in spec["state_counts"].items() if n}
    print(
        f"SpecSteady: {counts.get('SpecSteady', 0)} of {spec['decode_steps']} decode steps "
        f"({spec['spec_steady_fraction']:.1%}); async spec state_counts {counts}"
    )


def _print_sweep(data: dict) -> None:
    print(
        f"\nD/C sweep ({data['model']}, batch {data['batch']}, calibrated C {data['calibrated_C_ms']:.3f} ms, "
        f"program alone {data['program_alone_ms']:.3f} ms)"
    )
    print(
        f"{'D/C asked':>9s} {'how':>12s} {'D/C':>6s} {'speedup':>8s} {'ideal':>6s} {'ratio':>6s} "
        f"{'efficiency':>10s} {'ideal+O':>8s} {'eff+O':>6s}"
    )
    for p in data["points"]:
        asked = "-" if p["requested_ratio"] is None else f"{p['requested_ratio']:.2f}"
        print(
            f"{asked:>9s} {p['kind']:>12s} {p['D_over_C']:6.2f} {p['speedup']:8.3f} {p['ideal_speedup']:6.3f} "
            f"{p['speedup_vs_ideal']:6.3f} {p['overlap_efficiency']:10.2f} "
            f"{p['ideal_speedup_with_transport']:8.3f} {p['overlap_efficiency_with_transport']:6.2f}"
        )
    if any("pairs" in p for p in data["points"]):
        print(
            "\nEach pair, ms per step: C and D of its sync run; async: the async run's step, its host time C, "
            "its main thread's wait for an earlier step's output, the device's idle time and the device's own "
            "cost per program beyond the program (dev ovh)"
        )
    for p in data["points"]:
        if "pairs" in p:
            _print_sweep_pairs(p)


def _print_sweep_pairs(point: dict) -> None:
    """Each alternating pair of one sweep point, and how many reach the efficiency target."""
    asked = (
        "real compute" if point["requested_ratio"] is None else f"D/C {point['requested_ratio']:.2f} ({point['kind']})"
    )
    print(
        f"\npairs at {asked}: {point['pairs_at_target']} of {point['pairs_counted']} counted pairs reach "
        f"efficiency {point['efficiency_target']:.2f} (median {point['overlap_efficiency']:.2f})"
    )
    print(
        f"{'pair':>4s} {'first':>5s} {'speedup':>8s} {'ideal':>6s} {'efficiency':>10s} {'eff+O':>6s} {'D/C':>6s} "
        f"{'C ms':>6s} {'D ms':>6s} {'async ms':>8s} {'async C':>7s} {'wait':>6s} {'idle':>6s} {'dev ovh':>7s} "
        f"{'others':>6s} {'':>9s}"
    )
    for q in point["pairs"]:
        note = "" if q["counted"] else "excluded" if q["excluded"] else "unused"
        others = "-" if q["other_cpu"] is None or math.isnan(q["other_cpu"]) else f"{q['other_cpu']:.0%}"
        print(
            f"{q['repetition']:4d} {q['first']:>5s} {q['speedup']:8.3f} {q['ideal_speedup']:6.3f} "
            f"{q['overlap_efficiency']:10.2f} {q['overlap_efficiency_with_transport']:6.2f} {q['D_over_C']:6.2f} "
            f"{q['C_ms']:6.3f} {q['D_ms']:6.3f} {q['async_step_ms']:8.3f} {q['async_C_ms']:7.3f} "
            f"{q['async_wait_ms']:6.3f} {q['async_device_idle_ms']:6.3f} {q['async_device_overhead_ms']:7.3f} "
            f"{others:>6s} {note:>9s}"
        )


def _print_rows(title: str, rows: list[dict], key: str) -> None:
    print(f"\n{title}")
    print(f"{key:>8s} {'sync':>8s} {'async':>8s}")
    for r in rows:
        print(f"{r[key]:8d} {r['sync_host_us']:8.0f} {r['async_host_us']:8.0f}")


def _print_peer(data: dict) -> None:
    print(f"\ntokens/s vs transformers {data['transformers_version']} ({data['new_tokens']} new tokens, greedy)")
    print(f"{'batch':>6s} {'ours':>8s} {'theirs':>8s} {'ratio':>6s} {'agree':>6s}")
    for r in data["rows"]:
        print(
            f"{r['batch']:6d} {r['ours_tokens_per_s']:8.0f} {r['transformers_tokens_per_s']:8.0f} "
            f"{r['ratio']:6.2f} {r['token_agreement']:6.3f}"
        )
