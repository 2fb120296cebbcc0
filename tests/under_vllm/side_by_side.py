"""The same workload through vLLM's engine with our worker and through our own engine (docs/benchmarks.md).

Run in the vLLM lane's environment: `VLLM_PLUGINS=neuron_async_sm HF_HUB_OFFLINE=1 $venv/bin/python
tests/under_vllm/side_by_side.py [--reps 3] [--device-time-ms 0]`. Four engines are built once (vLLM async,
vLLM sync, ours async, ours sync), all on tiny-llama written as a checkpoint, the emulated device
process, the same max_num_seqs, and take turns on the workload (alternating runs, after one warm-up
each); prints one JSON line per run and the medians: output tokens/s, and per forward step the wall
time and the host's CPU time (this process and every process under it, vLLM's engine core included,
less the device processes: what the host spends to run a step, whichever thread or process).

`--serve`: instead, `vllm serve` with our plugin beside our `neuron-async-sm serve` on one checkpoint
(the lane's 64-token text model, with a tokenizer) and the same flags (async on, max_num_seqs 8), and
our `bench serve` taking turns on both: one client, one load, TTFT / ITL / throughput per rate.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REQUESTS, PROMPT_LEN, NEW_TOKENS, MAX_NUM_SEQS = 32, 32, 64, 8


def prompts() -> list[list[int]]:
    return [[1, *[3 + (17 * i + 7 * k) % 900 for k in range(PROMPT_LEN - 1)]] for i in range(REQUESTS)]


def tree_cpu_s(exclude: set[int]) -> float:
    """User + system CPU seconds of this process and its descendants (all threads), less `exclude`."""
    total, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            children = [int(c) for t in os.listdir(f"/proc/{pid}/task") for c in _children(pid, int(t))]
        except (OSError, ValueError):
            continue  # it exited meanwhile
        if pid not in exclude:
            total += int(fields[11]) + int(fields[12])
        todo += children
    return total / os.sysconf("SC_CLK_TCK")


def _children(pid: int, tid: int) -> list[str]:
    return Path(f"/proc/{pid}/task/{tid}/children").read_text().split()


def serve(args: argparse.Namespace) -> None:
    """Start both servers, run `bench serve --base-url vllm=... --base-url ours=...`, stop them."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: support.serve_harness
    from support.serve_harness import free_port, write_text_model

    folder = Path(tempfile.mkdtemp(prefix="side-by-side-serve-"))
    ckpt = str(write_text_model(folder / "ckpt", model_type="llama", torch_dtype="float32"))
    limits = ["--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", "64"]
    ports = {"vllm": free_port(), "ours": free_port()}
    argv = {
        "vllm": [
            str(Path(sys.executable).parent / "vllm"),
            *("serve", ckpt, "--port", str(ports["vllm"]), *limits),
            *("--additional-config", json.dumps({"neuron_async_sm": {"device_time_ms": args.device_time_ms}})),
        ],
        "ours": [
            *(sys.executable, "-m", "neuron_async_sm", "serve", "--model", ckpt, "--port", str(ports["ours"]), *limits),
            *("--async-scheduling", "--device-time-ms", str(args.device_time_ms)),
        ],
    }
    env = {**os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "fork"}  # vLLM's CLI would spawn (a re-import each)
    procs = {}
    try:
        for name, cmd in argv.items():
            with open(folder / f"{name}.log", "w") as log:
                procs[name] = subprocess.Popen(
                    cmd, env=env, cwd=folder, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
        for name, port in ports.items():
            deadline = time.monotonic() + 300
            while not _healthy(port):
                if procs[name].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{name} server not up; log {folder / name}.log")
                time.sleep(0.5)
        bench = [sys.executable, "-m", "neuron_async_sm", "bench", "serve", "--model", ckpt, "--input-len", "16"]
        bench += ["--output-len", "32", "--num-prompts", str(args.prompts), "--repetitions", str(args.reps)]
        bench += ["--request-rates", args.rates, "--json", str(folder / "report.json"), "--no-progress"]
        bench += [f"--base-url={name}=http://127.0.0.1:{port}" for name, port in ports.items()]
        subprocess.run(bench, check=True)
        print(f"report: {folder / 'report.json'}")
    finally:
        for proc in procs.values():
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device-time-ms", type=float, default=0.0)
    parser.add_argument("--serve", action="store_true", help="vllm serve with our plugin against our serve")
    parser.add_argument("--rates", default="8,inf", help="--serve: request rates (bench serve's --request-rates)")
    parser.add_argument("--prompts", type=int, default=32, help="--serve: requests per rate, per server, per rep")
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return

    from vllm import LLM as VllmLLM
    from vllm import SamplingParams as VllmParams

    from neuron_async_sm import LLM, PromptRequest, SamplingParams
    from neuron_async_sm.bench.checkpoint import write_checkpoint

    ckpt = str(write_checkpoint(Path(tempfile.mkdtemp()) / "tiny-llama"))
    engines = {}
    for mode in ("async", "sync"):
        engines[f"vllm-{mode}"] = VllmLLM(
            model=ckpt,
            skip_tokenizer_init=True,
            max_num_seqs=MAX_NUM_SEQS,
            max_model_len=PROMPT_LEN + NEW_TOKENS,
            async_scheduling=mode == "async",
            additional_config={"neuron_async_sm": {"device_time_ms": args.device_time_ms}},
            disable_log_stats=True,
        )
        engines[f"ours-{mode}"] = LLM(
            ckpt,
            max_num_seqs=MAX_NUM_SEQS,
            max_model_len=PROMPT_LEN + NEW_TOKENS,
            async_scheduling=mode == "async",
            device_time_ms=args.device_time_ms,
        )
    vllm_params = VllmParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, detokenize=False)
    ours_requests = [PromptRequest(p, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)) for p in prompts()]

    def steps(name: str) -> int:
        """Forward steps the engine has run (vLLM's: our worker's outputs, one per step it ran)."""
        if name.startswith("vllm"):
            return engines[name].collective_rpc("neuron_async_sm_stats")[0]["outputs_created"]
        return engines[name].engine.num_steps

    devices = {
        s["device_pid"]
        for n in engines
        if n.startswith("vllm")
        for s in engines[n].collective_rpc("neuron_async_sm_stats")
    }
    devices |= {r.device_pid for n in engines if n.startswith("ours") for r in engines[n].engine.runtimes}

    def run(name: str) -> dict:
        engine = engines[name]
        steps_before, cpu_before = steps(name), tree_cpu_s(devices)
        started = time.perf_counter()
        if name.startswith("vllm"):
            outs = engine.generate([{"prompt_token_ids": p} for p in prompts()], vllm_params, use_tqdm=False)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        else:
            tokens = sum(len(o.output_token_ids) for o in engine.generate(ours_requests))
        seconds = time.perf_counter() - started
        cpu, n = tree_cpu_s(devices) - cpu_before, steps(name) - steps_before
        return {
            "seconds": seconds,
            "tokens": tokens,
            "steps": n,
            "wall_ms_per_step": 1e3 * seconds / n,
            "host_cpu_ms_per_step": 1e3 * cpu / n,
        }

    for name in engines:
        run(name)  # warm-up
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for rep in range(args.reps):
        for name in engines:
            result = run(name)
            runs[name].append(result)
            print(json.dumps({"rep": rep, "engine": name, **{k: round(v, 3) for k, v in result.items()}}), flush=True)

    def median(name: str, key: str) -> float:
        return statistics.median(r["tokens"] / r["seconds"] if key == "rate" else r[key] for r in runs[name])

    medians = {name: median(name, "rate") for name in engines}
    summary = {
        "tokens_per_s": {name: round(rate, 1) for name, rate in medians.items()},
        "wall_ms_per_step": {name: round(median(name, "wall_ms_per_step"), 2) for name in engines},
        "host_cpu_ms_per_step": {name: round(median(name, "host_cpu_ms_per_step"), 2) for name in engines},
        "steps": {name: median(name, "steps") for name in engines},
        "async_speedup": {
            side: round(medians[f"{side}-async"] / medians[f"{side}-sync"], 3) for side in ("vllm", "ours")
        },
        "device_time_ms": args.device_time_ms,
    }
    print(json.dumps(summary), flush=True)
    for name, engine in engines.items():
        if name.startswith("vllm"):
            engine.llm_engine.engine_core.shutdown()
        else:
            engine.close()


if __name__ == "__main__":
    main()
