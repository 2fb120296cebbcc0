"""`neuron-async-sm bench serve`: the serving benchmark's command line, its servers, tables, JSON and plot.

Either it starts its own servers (`neuron-async-sm serve` processes on 127.0.0.1, one per mode: sync
and async unless `--async-scheduling` / `--no-async-scheduling` picks one) and stops them at the
end, or it sends to a running one (`--base-url`). The load and the figures are `bench/serving.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from neuron_async_sm.args import EXIT_FAILED, EXIT_OK, EXIT_USAGE, HelpFormatter, add_engine_args, positive_floats
from neuron_async_sm.bench.report import finite, machine, progress_bar
from neuron_async_sm.bench.runner import OtherLoad, load_average
from neuron_async_sm.bench.serving import LATENCIES, LoadSpec, Target, aggregate, rate_label, run_cells, warm_up

NOT_FORWARDED = ("async_scheduling", "trace_path", "stats", "no_progress")  # per mode, or no meaning for a server
START_TIMEOUT_S = 180.0  # a server that has not answered /health by then failed to start
STOP_TIMEOUT_S = 30.0  # SIGTERM, then SIGKILL after this long

SERVE_BENCH_HELP = """Benchmark a server under Poisson arrivals at a sweep of request rates (vLLM's `bench serve`).

Per rate: TTFT, TPOT, ITL and end-to-end latency (mean, p50, p99), requests/s and output tokens/s,
completed and failed counts. Without --base-url it starts one server per mode (sync and async, both
unless --async-scheduling / --no-async-scheduling picks one) on 127.0.0.1 and alternates them: each
(repetition, rate) cell runs on both, the order flipped cell by cell, with the same prompts and
arrival times; the figures are medians over the repetitions."""


def add_serve_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serving benchmark: Poisson arrivals at a sweep of rates, async vs sync",
        description=SERVE_BENCH_HELP,
        formatter_class=HelpFormatter,
    )
    known = {a.dest for a in p._actions}
    add_engine_args(p)
    engine_flags = [a for a in p._actions if a.dest not in known and a.dest not in NOT_FORWARDED]
    p.set_defaults(async_scheduling=None)  # None: both modes, alternating
    p.add_argument(
        "--base-url",
        action="append",
        default=None,
        help="a running server (e.g. http://127.0.0.1:8000) instead of our own; repeat it as LABEL=URL to "
        "take turns on several (vllm serve with our plugin and our serve, say)",
    )
    p.add_argument("--label", default="server", help="with one --base-url without a label: the mode name")
    p.add_argument(
        "--request-rates",
        type=positive_floats,
        default=(2.0, 4.0, 8.0, math.inf),
        help="requests per second, comma-separated; inf sends all at once",
    )
    p.add_argument("--num-prompts", type=int, default=32, help="requests per rate, per mode, per repetition")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens (random ids)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request (ignore_eos)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps: 1 Poisson, <1 burstier")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--repetitions", type=int, default=3, help="times each rate runs on each mode (medians)")
    p.add_argument("--warmup-prompts", type=int, default=4, help="unrecorded requests per server first")
    p.add_argument("--request-timeout-s", type=float, default=120.0, help="a request open longer fails")
    p.add_argument(
        "--max-other-cpu",
        type=float,
        default=None,
        metavar="SHARE",
        help="wait (up to 2 min) for other processes to use at most this share of the CPUs before each cell",
    )
    p.add_argument("--server-log-dir", default=None, help="our servers' logs (default: a temporary directory)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the report as JSON")
    p.add_argument("--plots", default=None, metavar="DIR", help="write bench_serve.png there (needs matplotlib)")
    p.set_defaults(func=run_bench_serve, engine_flags=engine_flags)


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags as `neuron-async-sm serve` takes them, every one spelt out (None: left at its default)."""
    argv = []
    for action in args.engine_flags:
        value, flag = getattr(args, action.dest), action.option_strings[0]
        if value is None:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, (list, tuple)):
            argv += [flag, ",".join(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


def _get(url: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except OSError:
        return 0, b""


class ServerProcess:
    """One `neuron-async-sm serve` on 127.0.0.1 and a free port; its log goes to a file."""

    def __init__(self, mode: str, flags: list[str], log_dir: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.mode, self.url = mode, f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server-{mode}-{self.port}.log"
        self.argv = [
            sys.executable,
            "-m",
            "neuron_async_sm",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *flags,
        ]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        self.exit_code: int | None = None

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the {self.mode} server exited at start ({self.proc.returncode}); "
                    f"log {self.log_path}:\n{self._tail()}"
                )
            if _get(self.url + "/health")[0] == 200:
                return
            time.sleep(0.2)
        raise RuntimeError(
            f"the {self.mode} server did not answer /health in {START_TIMEOUT_S:.0f} s; "
            f"log {self.log_path}:\n{self._tail()}"
        )

    def pids(self) -> tuple[int, ...]:
        """The server and its children (the device process): their CPU is not "other" load."""
        try:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except OSError:
            children = []
        return (self.proc.pid, *(int(c) for c in children))

    def stop(self) -> None:
        """SIGTERM (the server drains), SIGKILL past STOP_TIMEOUT_S; the exit code is kept."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.exit_code = self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.exit_code = self.proc.wait(timeout=10)

    def _tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def server_counters(base_url: str) -> dict[str, float]:
    """Steps by path state from the server's /metrics ("steps:Steady", "steps:Sync", ...); {} if none."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = _get(base_url + "/metrics", timeout_s=10)
    if status != 200:
        return {}
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == "neuron_async_sm_steps_total":
                out[f"steps:{sample.labels['state']}"] = sample.value
    return out


def _served_model(base_url: str) -> str:
    status, body = _get(base_url.rstrip("/") + "/v1/models", timeout_s=10)
    if status != 200:
        raise RuntimeError(f"{base_url}/v1/models answered {status or 'nothing'}")
    return json.loads(body)["data"][0]["id"]


def external_servers(base_urls: list[str], label: str) -> dict[str, str]:
    """--base-url values as {mode name: URL}: `LABEL=URL`, or a bare URL named `label` (one only)."""
    servers: dict[str, str] = {}
    for value in base_urls:
        name, sep, url = value.partition("=")
        name, url = (name, url) if sep and not name.startswith("http") else (label, value)
        if name in servers:
            raise ValueError(f"--base-url: two servers named {name!r}; name each as LABEL=URL")
        servers[name] = url.rstrip("/")
    return servers


def _validate(args: argparse.Namespace) -> None:
    if args.repetitions < 1 or args.warmup_prompts < 0:
        raise ValueError("--repetitions must be >= 1 and --warmup-prompts >= 0")
    if args.trace_path or args.stats:
        raise ValueError("--trace / --stats: not forwarded to the benchmark's servers; run `serve` with them")
    if args.base_url is not None and args.async_scheduling is not None:
        raise ValueError("--async-scheduling / --no-async-scheduling pick our own servers' mode; not with --base-url")
    # Checked before any server starts: not after the whole benchmark (plots) or as a server dying at start.
    if args.base_url is None and not all(importlib.util.find_spec(m) for m in ("fastapi", "uvicorn")):
        raise ValueError("our own servers need the 'serve' extra (pip install -e '.[serve]'), or give --base-url")
    if importlib.util.find_spec("openai") is None:
        raise ValueError("the benchmark's client is the openai package (pip install openai, or the dev extras)")
    if args.plots and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plots needs matplotlib (the dev extras: pip install -e '.[dev]')")


def run_bench_serve(args: argparse.Namespace) -> int:
    from neuron_async_sm.model.config import load_model_config

    try:
        _validate(args)
        external = external_servers(args.base_url or [], args.label)
        spec = LoadSpec(
            args.num_prompts,
            args.input_len,
            args.output_len,
            load_model_config(args.model).vocab_size,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            request_timeout_s=args.request_timeout_s,
        )
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    modes = list(external) if external else ["sync", "async"]
    if args.async_scheduling is not None:
        modes = ["async" if args.async_scheduling else "sync"]
    servers: list[ServerProcess] = []
    report: dict = {"machine": machine(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        if args.base_url is None:
            log_dir = Path(args.server_log_dir or tempfile.mkdtemp(prefix="bench-serve-"))
            log_dir.mkdir(parents=True, exist_ok=True)
            flags = engine_argv(args)
            for m in modes:  # appended one by one: the finally below stops whichever started
                mode_flag = "--async-scheduling" if m == "async" else "--no-async-scheduling"
                servers.append(ServerProcess(m, [*flags, mode_flag], log_dir))
            deadline = time.monotonic() + START_TIMEOUT_S  # started together, so the waits overlap
            for server in servers:
                server.wait_ready(deadline)
            endpoints = [(s.mode, s.url, args.model, s.pids()) for s in servers]
        else:
            endpoints = [(label, url, _served_model(url), ()) for label, url in external.items()]
        cells = args.repetitions * len(args.request_rates) * len(modes)
        advance, close = progress_bar(not args.no_progress, cells, "bench serve")
        try:
            runs = asyncio.run(_drive(endpoints, args, spec, advance))
        finally:
            close()
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        for server in servers:
            server.stop()
        signal.signal(signal.SIGTERM, previous_sigterm)
    report["machine"]["load_avg_end"] = load_average()
    report["config"] = {
        "model": args.model,
        "modes": modes,
        "request_rates": [rate_label(r) for r in args.request_rates],
        "num_prompts": spec.num_prompts,
        "input_len": spec.input_len,
        "output_len": spec.output_len,
        "burstiness": spec.burstiness,
        "max_concurrency": spec.max_concurrency,
        "repetitions": args.repetitions,
        "warmup_prompts": args.warmup_prompts,
        "seed": args.seed,
        "base_url": args.base_url,
    }
    report["servers"] = [{"mode": s.mode, "argv": s.argv[1:], "exit_code": s.exit_code} for s in servers]
    report["runs"] = runs
    report["results"] = aggregate(runs, modes, args.request_rates)
    _print_results(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(finite(report), indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    if args.plots:
        from neuron_async_sm.bench.plots import write_serve_plot

        print(f"wrote {write_serve_plot(report, args.plots)}")
    return EXIT_OK if all(r["failed"] == 0 for r in runs) else EXIT_FAILED


def _exit_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM ends the benchmark through the `finally` that stops our servers, as Ctrl-C does; its default
    action would end this process alone and leave both servers (and their device processes) running."""
    raise SystemExit(128 + signum)


async def _drive(
    endpoints: list[tuple[str, str, str, tuple[int, ...]]], args: argparse.Namespace, spec: LoadSpec, progress
) -> list[dict]:
    import openai

    clients = [
        openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=spec.request_timeout_s)
        for _, url, _, _ in endpoints
    ]
    targets = [
        Target(name, client, model, pids, functools.partial(server_counters, url))
        for (name, url, model, pids), client in zip(endpoints, clients, strict=True)
    ]

    async def quiet(window_s: float = 1.0, timeout_s: float = 120.0) -> float:
        """OtherLoad.wait_for_quiet, awaiting its windows: Ctrl-C cancels the run at once (asyncio.run's
        SIGINT cancels the task, which a blocking wait, or one on an executor thread, would sit out)."""
        if args.max_other_cpu is None:
            return math.nan
        deadline = time.perf_counter() + timeout_s
        while True:
            probe = OtherLoad([])
            await asyncio.sleep(window_s)
            share = probe.share()
            if not share > args.max_other_cpu or time.perf_counter() > deadline:  # NaN (no /proc): do not wait
                return share

    def other_load(pids: tuple[int, ...]):
        return OtherLoad([os.getpid(), *pids]).share

    try:
        await warm_up(targets, spec, args.warmup_prompts, args.seed)
        return await run_cells(
            targets,
            args.request_rates,
            spec,
            repetitions=args.repetitions,
            seed=args.seed,
            progress=progress,
            quiet=quiet,
            other_load=other_load,
        )
    finally:
        for client in clients:
            await client.close()


def _print_results(report: dict) -> None:
    c = report["config"]
    print(
        f"\nserving: {c['num_prompts']} prompts x {c['input_len']} -> {c['output_len']} tokens per rate, "
        f"{c['model']}, medians of {c['repetitions']} alternating runs per mode (ms)"
    )
    head = f"{'rate':>5s} {'mode':>6s} {'ok':>4s} {'fail':>4s} {'req/s':>6s} {'tok/s':>7s}"
    head += "".join(f" {n.upper() + ' ' + q:>10s}" for n in LATENCIES for q in ("p50", "p99"))
    print(head)
    for label in c["request_rates"]:
        for mode, rows in report["results"].items():
            r = next(x for x in rows if x["rate_label"] == label)
            line = f"{label:>5s} {mode:>6s} {r['completed']:4d} {r['failed']:4d} {r['request_throughput']:6.2f} "
            line += f"{r['output_throughput']:7.0f}"
            line += "".join(f" {r[f'{n}_ms_{q}']:10.2f}" for n in LATENCIES for q in ("p50", "p99"))
            print(line)
