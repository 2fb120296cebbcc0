"""`neuron-async-sm generate` and `demo`: run requests through `LLM`, keep each result as it finishes.

`generate` reads one request per JSONL line (a bad line becomes that request's error result);
`demo` makes a seeded mix on tiny-llama. Both write `OUT.jsonl` through `ResultsFile`, print a
summary line, and return an exit code (`args.EXIT_*`); Ctrl-C / SIGTERM keep what finished.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from neuron_async_sm.args import (
    EXIT_CODES_HELP,
    EXIT_FAILED,
    EXIT_OK,
    HelpFormatter,
    add_engine_args,
    create_output_file,
    engine_config,
)
from neuron_async_sm.config import ConfigError
from neuron_async_sm.engine.llm import LLM, PromptRequest
from neuron_async_sm.model import ModelLoadError
from neuron_async_sm.outputs import RequestOutput
from neuron_async_sm.results_file import ResultsFile, ResultsWriteError
from neuron_async_sm.runtime import DeviceStartupError
from neuron_async_sm.sampling_params import InvalidRequestError, SamplingParams
from neuron_async_sm.serve.tokenizer import ServedTokenizer
from neuron_async_sm.values import is_int

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
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "structured_outputs",
    "arrival_step",
}


GENERATE_HELP = """Generate for every request of a JSONL file.

Input, one JSON object per line (blank lines skipped):
  {"request_id"?: str, "prompt_token_ids": [int] | "prompt": str, "max_tokens": int,
   "temperature"?: float, "top_k"?: int, "top_p"?: float, "seed"?: int,
   "stop_token_ids"?: [int], "ignore_eos"?: bool, "presence_penalty"?: float,
   "frequency_penalty"?: float, "repetition_penalty"?: float, "min_p"?: float, "min_tokens"?: int,
   "logit_bias"?: {"token id": float}, "allowed_token_ids"?: [int], "bad_words"?: [str],
   "arrival_step"?: int,
   "structured_outputs"?: {"json": schema | true, "regex": str, "choice": [str], "grammar": str}}
  ("prompt" text needs a tokenizer.json in the model directory; a line without request_id is line-N)
Output, one line per input line, in input order (OUT.partial holds them in completion order while
the run goes on):
  {"request_id", "output_token_ids", "finish_reason": "stop"|"length"|"abort"|"error", "error",
   "text" (when the model has a tokenizer: the output decoded after its prompt, as vLLM's)}
A bad line gets an "error" line naming the field; every other request still runs."""


def add_generate_parsers(sub: argparse._SubParsersAction) -> None:
    """`generate` and `demo`."""
    gen = sub.add_parser(
        "generate",
        help="generate for every request of a JSONL file",
        formatter_class=HelpFormatter,
        description=GENERATE_HELP,
        epilog=EXIT_CODES_HELP,
    )
    gen.add_argument("--prompts", required=True, metavar="IN.jsonl", help="one request per line (see above)")
    gen.add_argument("--output", required=True, metavar="OUT.jsonl", help="one result per request, in input order")
    add_engine_args(gen)
    gen.set_defaults(func=run_generate)

    demo = sub.add_parser(
        "demo",
        help="a demo generation on tiny-llama; prints tokens/s",
        description="Generate for a seeded mix of random prompts; print tokens/s.",
        formatter_class=HelpFormatter,
        epilog=EXIT_CODES_HELP,
    )
    demo.add_argument("--output", default="out/demo.jsonl", help="results, one line per request")
    demo.add_argument("--num-requests", type=int, default=32, help="how many requests")
    add_engine_args(demo)
    demo.set_defaults(func=run_demo)


def parse_request_line(line: str, index: int, tokenizer: ServedTokenizer | None) -> PromptRequest:
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
        prompt = tokenizer.encode(obj["prompt"])
    else:
        raise InvalidRequestError("prompt_token_ids: missing (or give 'prompt' text)")
    if "max_tokens" not in obj:
        raise InvalidRequestError("max_tokens: missing")
    params_fields = (
        *("max_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", "ignore_eos"),
        *("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias"),
        *("allowed_token_ids", "bad_words"),  # bad_words: tokenized by the engine (vLLM's rule)
        "structured_outputs",  # one of json, regex, choice, grammar (structured_output.py)
    )
    fields = {k: obj[k] for k in params_fields if k in obj}
    bias = fields.get("logit_bias")
    if isinstance(bias, dict):  # JSON keys are strings: token ids written as decimal strings
        fields["logit_bias"] = {int(k) if isinstance(k, str) and k.isdecimal() else k: v for k, v in bias.items()}
    params = SamplingParams(**fields)
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
    tokenizer = ServedTokenizer.load(args.model)
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


def _run_requests(
    args: argparse.Namespace, items: list[PromptRequest | RequestOutput], tokenizer: ServedTokenizer | None
) -> int:
    """Run every request, keeping each result durable as it finishes; return the exit code.

    Rejected lines (RequestOutput) are results already. Exit codes: see `args.EXIT_*`.
    """
    # Checked before the engine starts: an unwritable path must not cost the whole compute.
    create_output_file(args.stats, "--stats")
    results = ResultsFile(args.output, [item.request_id for item in items], tokenizer)
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
                with LLM.from_config(engine_config(args)) as llm:
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
