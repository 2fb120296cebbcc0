"""`neuron-async-sm`: generate from a JSONL file, run the demo, draw the state diagram, benchmark."""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path

from neuron_async_sm.bench.command import add_bench_parser
from neuron_async_sm.config import DEVICES, DTYPES, ConfigError, EngineConfig
from neuron_async_sm.engine.llm import LLM, PromptRequest
from neuron_async_sm.model import ModelLoadError, tokenizer_path
from neuron_async_sm.outputs import RequestOutput
from neuron_async_sm.runtime import DeviceStartupError
from neuron_async_sm.sampling_params import InvalidRequestError, SamplingParams

REQUEST_FIELDS = {
    "request_id", "prompt_token_ids", "prompt", "max_tokens", "temperature", "top_k", "top_p", "seed",
    "stop_token_ids", "ignore_eos", "arrival_step",
}  # fmt: skip


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    p.add_argument("--model", default=d.model, help="'tiny-llama' or a local Hugging Face Llama checkpoint dir")
    p.add_argument("--device", default=d.device, choices=DEVICES, help="cpu: emulated Neuron device process")
    p.add_argument("--dtype", default=d.dtype, choices=DTYPES)
    p.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
        help="overlap host work with device execution (default on)",
    )  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens, help="token budget")
    p.add_argument("--decode-buckets", type=_int_list, default=d.decode_buckets, help="e.g. 1,2,4,8")
    p.add_argument("--prefill-buckets", type=_int_list, default=d.prefill_buckets, help="e.g. 16,32,64,128,256")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--runtime-queue-depth", type=int, default=d.runtime_queue_depth)
    p.add_argument("--device-time-ms", type=float, default=d.device_time_ms, help="emulated program time")
    p.add_argument("--trace", default=None, metavar="FILE.ndjson", help="write machine transitions")
    p.add_argument("--stats", default=None, metavar="STATS.json", help="write run statistics as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _engine_config(args: argparse.Namespace) -> dict:
    return {
        "device": args.device,
        "dtype": args.dtype,
        "async_scheduling": args.async_scheduling,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "decode_buckets": args.decode_buckets,
        "prefill_buckets": args.prefill_buckets,
        "seed": args.seed,
        "runtime_queue_depth": args.runtime_queue_depth,
        "device_time_ms": args.device_time_ms,
        "trace_path": args.trace,
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
    if not isinstance(arrival, int) or isinstance(arrival, bool) or arrival < 0:
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
    parsed: list[PromptRequest | RequestOutput] = []
    seen_ids: set[str] = set()
    for i, line in enumerate(Path(args.prompts).read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue  # blank lines are skipped, but still counted so "line N" matches the file
        try:
            request = parse_request_line(line, i, tokenizer)
            if request.request_id is None:
                request = PromptRequest(request.prompt_token_ids, request.sampling_params, f"line-{i + 1}",
                                        request.arrival_step)  # fmt: skip
            # Checked here, not only by the engine: the engine forgets finished ids, so a repeat that
            # arrives later would be accepted and its output merged with the first one's.
            if request.request_id in seen_ids:
                raise InvalidRequestError(f"request_id: duplicate request id {request.request_id!r}")
            seen_ids.add(request.request_id)
            parsed.append(request)
        except (InvalidRequestError, TypeError) as exc:
            error_id = _own_request_id(line, seen_ids) or f"line-{i + 1}"
            seen_ids.add(error_id)  # a later line reusing it would make two outputs with one id
            parsed.append(RequestOutput(error_id, [], [], True, "error", str(exc)))
    requests = [p for p in parsed if isinstance(p, PromptRequest)]
    started = time.perf_counter()
    with LLM(args.model, **_engine_config(args)) as llm:
        outputs = iter(llm.generate(requests, use_tqdm=not args.no_progress))
        stats = llm.stats()
    elapsed = time.perf_counter() - started
    results = [next(outputs) if isinstance(p, PromptRequest) else p for p in parsed]
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as f:
        for result in results:
            f.write(json.dumps(result.to_json()) + "\n")
    _report(stats, elapsed, args.stats, len(results), sum(r.finish_reason == "error" for r in results))
    return 0


def run_demo(args: argparse.Namespace) -> int:
    """Generate on tiny-llama with a seeded mix of prompts; print tokens/s and write the outputs."""
    rng = random.Random(args.seed)
    requests = [
        PromptRequest(
            [rng.randrange(3, 1000) for _ in range(rng.randint(4, 48))],
            SamplingParams(max_tokens=rng.randint(32, 128), temperature=rng.choice([0.0, 0.8]), seed=i),
            f"demo-{i}",
        )
        for i in range(args.num_requests)
    ]
    started = time.perf_counter()
    with LLM(args.model, **_engine_config(args)) as llm:
        outputs = llm.generate(requests, use_tqdm=not args.no_progress)
        stats = llm.stats()
    elapsed = time.perf_counter() - started
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as f:
        for result in outputs:
            f.write(json.dumps(result.to_json()) + "\n")
    print(f"wrote {len(outputs)} outputs to {args.output}")
    _report(stats, elapsed, args.stats, len(outputs), sum(r.finish_reason == "error" for r in outputs))
    return 0


def _report(stats: dict, elapsed: float, stats_path: str | None, num: int, num_errors: int) -> None:
    stats = {**stats, "requests": num, "errors": num_errors, "wall_s": elapsed}
    line = f"{num} requests, {stats['output_tokens']} tokens in {stats['elapsed_s']:.2f}s: "
    line += f"{stats['tokens_per_s']:.1f} tokens/s"
    if "async_steps" in stats:
        line += f"; async steps {stats['async_steps']}, sync fallback steps {stats['sync_fallback_steps']}"
    print(line)
    if stats_path:
        Path(stats_path).parent.mkdir(parents=True, exist_ok=True)
        Path(stats_path).write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="neuron-async-sm", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine stats periodically")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate for every request of a JSONL file")
    gen.add_argument("--prompts", required=True, metavar="IN.jsonl")
    gen.add_argument("--output", required=True, metavar="OUT.jsonl")
    _add_engine_args(gen)
    gen.set_defaults(func=run_generate)

    demo = sub.add_parser("demo", help="a demo generation on tiny-llama; prints tokens/s")
    demo.add_argument("--output", default="out/demo.jsonl")
    demo.add_argument("--num-requests", type=int, default=32)
    _add_engine_args(demo)
    demo.set_defaults(func=run_demo)

    diagram = sub.add_parser("diagram", help="draw the worker's state machine from its transition table")
    diagram.add_argument("--output", default="docs/state_machine", help="path without suffix (.dot/.svg/.png)")
    diagram.set_defaults(func=run_diagram)

    add_bench_parser(sub)  # neuron_async_sm/bench/command.py
    return parser


def run_diagram(args: argparse.Namespace) -> int:
    from neuron_async_sm.worker.diagram import write_state_diagram

    for path in write_state_diagram(args.output):
        print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return args.func(args)
    except (ConfigError, ModelLoadError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except DeviceStartupError as exc:
        # The model is loaded inside the device; its message ends with the device-side traceback,
        # whose last line is the cause (e.g. "ModelLoadError: model directory X has no checkpoint").
        cause = [ln for ln in str(exc).splitlines() if ln.strip()][-1:] or ["unknown cause"]
        print(f"error: the device failed to start: {cause[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
