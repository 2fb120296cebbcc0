"""`neuron-async-sm`: generate from a JSONL file, run the demo, draw the state diagram, benchmark."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from neuron_async_sm.bench.command import add_bench_parser
from neuron_async_sm.config import DEVICES, DTYPES, EXECUTOR_BACKENDS, ConfigError, EngineConfig
from neuron_async_sm.engine.llm import LLM, PromptRequest
from neuron_async_sm.model import ModelLoadError, tokenizer_path
from neuron_async_sm.outputs import RequestOutput
from neuron_async_sm.results_file import ResultsFile, ResultsWriteError
from neuron_async_sm.runtime import DeviceStartupError
from neuron_async_sm.sampling_params import InvalidRequestError, SamplingParams
from neuron_async_sm.serve.command import add_serve_parser
from neuron_async_sm.values import is_int

EXIT_OK = 0  # every request succeeded
EXIT_FAILED = 1  # at least one request failed (bad line, engine error); every other result is still written
EXIT_USAGE = 2  # usage or configuration error: nothing ran
# 128 + signum (130 SIGINT, 143 SIGTERM): interrupted; the finished results are kept, the rest is 'abort'
SUCCEEDED = ("stop", "length")

REQUEST_FIELDS = {
    "request_id",
    "prompt_token_ids",
    "prompt",
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    "arrival_step",
}


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def _csv(sizes: tuple[int, ...]) -> str:
    """A default as the user would type it; argparse parses a string default with the flag's type."""
    return ",".join(map(str, sizes))


def _add_engine_args(p: argparse.ArgumentParser, *, progress: bool = True) -> None:
    """The engine's flags, plus --trace and --stats; --no-progress only where a progress bar exists
    (`serve` has none)."""
    d = EngineConfig()
    p.add_argument("--model", default=d.model, help="'tiny-llama' or a local Hugging Face Llama checkpoint dir")
    p.add_argument("--device", default=d.device, choices=DEVICES, help="cpu: emulated Neuron device process")
    p.add_argument("--dtype", default=d.dtype, choices=DTYPES, help="weights, activations and KV cache")
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=d.async_scheduling,
        help="overlap host work with device execution",
    )
    p.add_argument(
        "--async-relay",
        action=argparse.BooleanOptionalAction,
        default=d.async_relay,
        help="async mode: when the batch changes, build input ids on the device from the previous step's "
        "sampled tokens instead of breaking the async flow",
    )
    p.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=d.enforce_eager,
        help="run the model op by op; --no-enforce-eager compiles one program per bucket at start-up",
    )
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="requests running at once")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=d.max_model_len,
        help="positions per request (default: the model's max_position_embeddings, reduced to fit the KV cache budget)",
    )
    p.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=d.kv_cache_memory_gb,
        help="KV cache memory budget in GiB (default: half the memory available at start)",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens, help="token budget")
    p.add_argument("--decode-buckets", type=_int_list, default=_csv(d.decode_buckets), help="e.g. 1,2,4,8")
    p.add_argument("--prefill-buckets", type=_int_list, default=_csv(d.prefill_buckets), help="e.g. 16,32,64,128,256")
    p.add_argument("--seed", type=int, default=d.seed, help="tiny-llama weights; seeds of unseeded requests")
    p.add_argument("--runtime-queue-depth", type=int, default=d.runtime_queue_depth, help="programs in flight")
    p.add_argument("--device-time-ms", type=float, default=d.device_time_ms, help="emulated program time")
    p.add_argument("--device-timeout-s", type=float, default=d.device_timeout_s, help="hung if no progress (0: off)")
    p.add_argument(
        "--device-startup-timeout-s",
        type=float,
        default=d.device_startup_timeout_s,
        help="fail if the device is not ready (model loaded, warmed up) within this long (0: off)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=d.tensor_parallel_size,
        help="ranks the model is split over, one device process each",
    )
    p.add_argument(
        "--distributed-executor-backend",
        default=d.distributed_executor_backend,
        choices=EXECUTOR_BACKENDS,
        help="how the ranks' device processes run",
    )
    p.add_argument("--trace", default=None, metavar="FILE.ndjson", help="write machine transitions")
    p.add_argument("--stats", default=None, metavar="STATS.json", help="write run statistics as JSON")
    if progress:
        p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _engine_config(args: argparse.Namespace) -> dict:
    return {
        "device": args.device,
        "dtype": args.dtype,
        "async_scheduling": args.async_scheduling,
        "async_relay": args.async_relay,
        "enforce_eager": args.enforce_eager,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "kv_cache_memory_gb": args.kv_cache_memory_gb,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "decode_buckets": args.decode_buckets,
        "prefill_buckets": args.prefill_buckets,
        "seed": args.seed,
        "runtime_queue_depth": args.runtime_queue_depth,
        "device_time_ms": args.device_time_ms,
        "device_timeout_s": args.device_timeout_s,
        "device_startup_timeout_s": args.device_startup_timeout_s,
        "trace_path": args.trace,
        "tensor_parallel_size": args.tensor_parallel_size,
        "distributed_executor_backend": args.distributed_executor_backend,
    }


def parse_request_line(line: str, index: int, tokenizer: object | None) -> PromptRequest:
    """One JSONL line -> PromptRequest; InvalidRequestError names the bad field."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"line {index + 1}: malformed JSON ({exc.msg})") from exc
    if not isinstance(obj, dict):
        raise InvalidRequestError(f"line {index + 1}: expected a JSON object")
    unknown = set(obj) - REQUEST_FIELDS
    if unknown:
        raise InvalidRequestError(f"{sorted(unknown)[0]}: unknown field")
    if "prompt_token_ids" in obj:
        prompt = obj["prompt_token_ids"]
        if not isinstance(prompt, list):
            raise InvalidRequestError("prompt_token_ids: must be a list of integers")
    elif "prompt" in obj:
        if tokenizer is None:
            raise InvalidRequestError("prompt: text prompts need a tokenizer.json in the model directory")
        if not isinstance(obj["prompt"], str):
            raise InvalidRequestError("prompt: must be a string")
        prompt = tokenizer.encode(obj["prompt"]).ids  # type: ignore[attr-defined]
    else:
        raise InvalidRequestError("prompt_token_ids: missing (or give 'prompt' text)")
    if "max_tokens" not in obj:
        raise InvalidRequestError("max_tokens: missing")
    params_fields = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", "ignore_eos")
    params = SamplingParams(**{k: obj[k] for k in params_fields if k in obj})
    arrival = obj.get("arrival_step", 0)
    if not is_int(arrival) or arrival < 0:
        raise InvalidRequestError(f"arrival_step: must be an integer >= 0, got {arrival!r}")
    request_id = obj.get("request_id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidRequestError(f"request_id: must be a string, got {request_id!r}")
    return PromptRequest(prompt, params, request_id, arrival)


def _own_request_id(line: str, seen_ids: set[str]) -> str | None:
    """The request_id a rejected line carried, so its error can be matched to it; None when the line
    has no usable id (malformed JSON, not a string) or the id is already taken (a duplicate)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return None
    request_id = obj.get("request_id") if isinstance(obj, dict) else None
    return request_id if isinstance(request_id, str) and request_id not in seen_ids else None


def run_generate(args: argparse.Namespace) -> int:
    tokenizer = None
    path = tokenizer_path(args.model)
    if path is not None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(path)
    items: list[PromptRequest | RequestOutput] = []
    seen_ids: set[str] = set()
    try:
        lines = Path(args.prompts).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"prompts: cannot read {args.prompts}: {getattr(exc, 'strerror', None) or exc}") from exc
    for i, line in enumerate(lines):
        if not line.strip():
            continue  # blank lines are skipped, but still counted so "line N" matches the file
        try:
            request = parse_request_line(line, i, tokenizer)
            if request.request_id is None:
                request = PromptRequest(
                    request.prompt_token_ids, request.sampling_params, f"line-{i + 1}", request.arrival_step
                )
            # Checked here, not only by the engine: the engine forgets finished ids, so a repeat that
            # arrives later would be accepted and its output merged with the first one's.
            if request.request_id in seen_ids:
                raise InvalidRequestError(f"request_id: duplicate request id {request.request_id!r}")
            seen_ids.add(request.request_id)
            items.append(request)
        except (InvalidRequestError, TypeError) as exc:
            error_id = _own_request_id(line, seen_ids) or f"line-{i + 1}"
            seen_ids.add(error_id)  # a later line reusing it would make two outputs with one id
            items.append(RequestOutput(error_id, [], [], True, "error", str(exc)))
    return _run_requests(args, items, tokenizer)


def run_demo(args: argparse.Namespace) -> int:
    """Generate on tiny-llama with a seeded mix of prompts; print tokens/s and write the outputs."""
    rng = random.Random(args.seed)
    requests: list[PromptRequest | RequestOutput] = [
        PromptRequest(
            [rng.randrange(3, 1000) for _ in range(rng.randint(4, 48))],
            SamplingParams(max_tokens=rng.randint(32, 128), temperature=rng.choice([0.0, 0.8]), seed=i),
            f"demo-{i}",
        )
        for i in range(args.num_requests)
    ]
    return _run_requests(args, requests, None)


def check_writable(path: str | None, flag: str) -> None:
    """A file written at the end of a run, checked before any compute (its directory made, the file
    created): an unwritable path must not cost the whole run. ConfigError naming the flag."""
    if path is None:
        return
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).touch()
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot write {path}: {exc.strerror or exc}") from exc


def _run_requests(args: argparse.Namespace, items: list[PromptRequest | RequestOutput], tokenizer: object) -> int:
    """Run every request, keeping each result durable as it finishes; return the exit code.

    Rejected lines (RequestOutput) are results already. Exit codes: see EXIT_* above.
    """
    # Checked before the engine starts: an unwritable path must not cost the whole compute.
    check_writable(args.stats, "--stats")
    results = ResultsFile(args.output, [item.request_id for item in items], tokenizer)  # type: ignore[misc]
    outputs: dict[str, RequestOutput] = {}

    def finished(output: RequestOutput) -> None:
        outputs[output.request_id] = output
        results.add(output)

    started = time.perf_counter()
    stats: dict = {}
    signum: int | None = None
    try:
        with _signals_interrupt():
            try:
                for item in items:
                    if isinstance(item, RequestOutput):
                        finished(item)  # a rejected line is a result already
                requests = [item for item in items if isinstance(item, PromptRequest)]
                with LLM(args.model, **_engine_config(args)) as llm:
                    try:
                        llm.generate(requests, use_tqdm=not args.no_progress, on_finish=finished)
                    finally:
                        stats = llm.stats()
            except Interrupted as exc:
                signum = exc.signum
                print(
                    f"\ninterrupted by {signal.Signals(signum).name}: keeping the {len(outputs)} finished "
                    f"requests; the other {len(items) - len(outputs)} end as 'abort'",
                    file=sys.stderr,
                )
            results.finish(f"interrupted by {signal.Signals(signum).name}" if signum else None)
    except (ConfigError, ModelLoadError, DeviceStartupError):
        results.close(remove_partial=True)  # nothing ran: no partial output to keep
        raise
    except ResultsWriteError as exc:
        # After the engine started: whatever finished is in OUT.partial; the run did not succeed.
        print(f"error: {exc.strerror}; the requests finished so far are in {results.partial_path}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        results.close()  # a run that could not finish keeps OUT.partial: every line written so far
    elapsed = time.perf_counter() - started
    ordered = [outputs.get(item.request_id) for item in items]
    print(f"wrote {len(items)} outputs to {args.output}")
    _report(stats, elapsed, args.stats, ordered)
    if signum is not None:
        return 128 + signum
    return EXIT_OK if all(o is not None and o.finish_reason in SUCCEEDED for o in ordered) else EXIT_FAILED


def _error_kind(message: str | None) -> str:
    """'DeviceLostError' for an engine failure ("Name: detail"), else 'invalid request' (a field's error)."""
    head = (message or "").split(":", 1)[0]
    return head if head.isidentifier() and head[:1].isupper() else "invalid request"


def _report(stats: dict, elapsed: float, stats_path: str | None, outputs: list[RequestOutput | None]) -> None:
    """The summary line (and the --stats file): how many succeeded, how many failed, and why."""
    failures: dict[str, str] = {}  # kind -> first message of that kind, in input order
    aborted = 0
    for output in outputs:
        if output is None or output.finish_reason == "abort":
            aborted += 1
        elif output.finish_reason == "error":
            failures.setdefault(_error_kind(output.error), output.error or "")
    failed = sum(o is not None and o.finish_reason == "error" for o in outputs)
    succeeded = len(outputs) - failed - aborted
    stats = {
        **stats,
        "requests": len(outputs),
        "succeeded": succeeded,
        "errors": failed,
        "aborted": aborted,
        "wall_s": elapsed,
    }
    line = f"{len(outputs)} requests: {succeeded} succeeded, {failed} failed"
    line += f", {aborted} aborted" if aborted else ""
    if "output_tokens" in stats:
        line += f"; {stats['output_tokens']} tokens in {stats['elapsed_s']:.2f}s: {stats['tokens_per_s']:.1f} tokens/s"
    if "async_steps" in stats:
        line += f"; async steps {stats['async_steps']}, sync fallback steps {stats['sync_fallback_steps']}"
    print(line)
    for kind, message in failures.items():
        count = sum(o is not None and o.finish_reason == "error" and _error_kind(o.error) == kind for o in outputs)
        print(f"  {count} failed with {kind}; first: {message}", file=sys.stderr)
    if stats_path:
        Path(stats_path).write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached the main thread; `signum` says which (the exit code is 128 + signum)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """The first SIGINT/SIGTERM raises Interrupted in the main thread (the run then keeps what finished
    and writes the rest as 'abort'); a second one exits at once. Previous handlers come back after."""
    seen: list[int] = []

    def handler(signum: int, frame: object) -> None:
        if seen:  # the user insists: OUT.partial already holds every finished request
            os._exit(128 + signum)
        seen.append(signum)
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


GENERATE_HELP = """Generate for every request of a JSONL file.

Input, one JSON object per line (blank lines skipped):
  {"request_id"?: str, "prompt_token_ids": [int] | "prompt": str, "max_tokens": int,
   "temperature"?: float, "top_k"?: int, "top_p"?: float, "seed"?: int,
   "stop_token_ids"?: [int], "ignore_eos"?: bool, "arrival_step"?: int}
  ("prompt" text needs a tokenizer.json in the model directory; a line without request_id is line-N)
Output, one line per input line, in input order (OUT.partial holds them in completion order while
the run goes on):
  {"request_id", "output_token_ids", "finish_reason": "stop"|"length"|"abort"|"error", "error",
   "text" (when the model has a tokenizer)}
A bad line gets an "error" line naming the field; every other request still runs."""

EXIT_CODES_HELP = """exit codes: 0 every request succeeded; 1 at least one request failed (every other result is
still written); 2 usage or configuration error (nothing ran); 130/143 interrupted by SIGINT/SIGTERM
(finished results kept, the others written as "abort"; a second Ctrl-C exits at once)."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown for every flag that has one; descriptions and epilogs keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="neuron-async-sm", description=__doc__, epilog=EXIT_CODES_HELP, formatter_class=_HelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine stats periodically")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser(
        "generate",
        help="generate for every request of a JSONL file",
        formatter_class=_HelpFormatter,
        description=GENERATE_HELP,
        epilog=EXIT_CODES_HELP,
    )
    gen.add_argument("--prompts", required=True, metavar="IN.jsonl", help="one request per line (see above)")
    gen.add_argument("--output", required=True, metavar="OUT.jsonl", help="one result per request, in input order")
    _add_engine_args(gen)
    gen.set_defaults(func=run_generate)

    demo = sub.add_parser(
        "demo",
        help="a demo generation on tiny-llama; prints tokens/s",
        description="Generate for a seeded mix of random prompts; print tokens/s.",
        formatter_class=_HelpFormatter,
        epilog=EXIT_CODES_HELP,
    )
    demo.add_argument("--output", default="out/demo.jsonl", help="results, one line per request")
    demo.add_argument("--num-requests", type=int, default=32, help="how many requests")
    _add_engine_args(demo)
    demo.set_defaults(func=run_demo)

    diagram = sub.add_parser(
        "diagram", help="draw the worker's state machine from its transition table", formatter_class=_HelpFormatter
    )
    diagram.add_argument("--output", default="docs/state_machine", help="path without suffix (.dot/.svg/.png)")
    diagram.set_defaults(func=run_diagram)

    add_bench_parser(sub)  # neuron_async_sm/bench/command.py
    add_serve_parser(sub)  # neuron_async_sm/serve/command.py
    return parser


def run_diagram(args: argparse.Namespace) -> int:
    from neuron_async_sm.worker.diagram import write_state_diagram

    written = write_state_diagram(args.output)
    for path in written:
        print(f"wrote {path}")
    if len(written) == 1:  # only the DOT source: Graphviz's `dot` is missing
        svg = written[0].with_suffix(".svg")
        print(
            f"note: SVG/PNG need Graphviz's `dot` (apt-get install graphviz, then rerun), or render the "
            f"source elsewhere: dot -Tsvg {written[0]} -o {svg}",
            file=sys.stderr,
        )
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # usage errors: argparse exits with EXIT_USAGE
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return args.func(args)
    except (ConfigError, ModelLoadError, OSError) as exc:
        print(f"error: {exc or type(exc).__name__}", file=sys.stderr)  # never an empty message
        return EXIT_USAGE
    except DeviceStartupError as exc:
        # The model is loaded inside the device; its message ends with the device-side traceback,
        # whose last line is the cause (e.g. "ModelLoadError: model directory X has no checkpoint").
        cause = [ln for ln in str(exc).splitlines() if ln.strip()][-1:] or ["unknown cause"]
        print(f"error: the device failed to start: {cause[0]}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # outside a run (start-up, diagram): one line, not a traceback
        print("\ninterrupted", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
