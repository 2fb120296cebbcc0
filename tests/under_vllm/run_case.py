"""One vLLM case in its own process: `python run_case.py CASE ARGS_JSON OUT_JSON`.

Run by tests/under_vllm (harness.run_case) under a hard timeout: vLLM's start-up RPCs wait forever when
a worker dies early. The case writes what it saw (platform, tokens, our workers' counters) to
OUT_JSON; the test asserts. Every engine runs vLLM's own LLM / LLMEngine; nothing of ours is mocked.
"""

from __future__ import annotations

import gc
import json
import sys
import time


def case_platform(args: dict) -> dict:
    """Which platform vLLM resolved in this process (VLLM_PLUGINS decides whether ours is active)."""
    from vllm.platforms import current_platform

    cls = type(current_platform)
    return {"platform": f"{cls.__module__}.{cls.__qualname__}", "out_of_tree": current_platform.is_out_of_tree()}


# vLLM SamplingParams fields a workload item may set as they are (JSON values)
PASSED_THROUGH = (
    "top_k",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "allowed_token_ids",
    "bad_words",
)


def _params(raw: dict):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    extra = {name: raw[name] for name in PASSED_THROUGH if name in raw}
    if "logit_bias" in raw:  # JSON keys are strings
        extra["logit_bias"] = {int(token): bias for token, bias in raw["logit_bias"].items()}
    if "structured_outputs" in raw:
        extra["structured_outputs"] = StructuredOutputsParams(**raw["structured_outputs"])
    return SamplingParams(
        max_tokens=raw["max_tokens"],
        temperature=raw.get("temperature", 0.0),
        seed=raw.get("seed"),
        stop_token_ids=raw.get("stop_token_ids", []),
        ignore_eos=raw.get("ignore_eos", True),
        **extra,
    )


def _logprobs(positions) -> list | None:
    """vLLM's logprobs per position (None for a prompt's first) as [[token, logprob, rank], ...], in
    its order: the chosen token first, then the most likely ones."""
    if positions is None:
        return None
    return [
        None if position is None else [[token, lp.logprob, lp.rank] for token, lp in position.items()]
        for position in positions
    ]


def _engine(ckpt: str, run: dict):
    import torch
    from vllm import LLM

    dtype = run.get("dtype", "float32")
    return LLM(
        model=ckpt,
        dtype=torch.float64 if dtype == "float64" else dtype,  # vLLM's dtype strings stop at float32
        max_num_seqs=run.get("max_num_seqs", 4),
        max_model_len=run.get("max_model_len", 64),
        max_num_batched_tokens=run.get("max_num_batched_tokens", 64),
        async_scheduling=run["async"],
        tensor_parallel_size=run.get("tp", 1),
        distributed_executor_backend=run.get("backend"),
        num_gpu_blocks_override=run.get("num_gpu_blocks"),
        additional_config={"neuron_async_sm": run.get("options", {})},
        structured_outputs_config=run.get("structured_outputs_config"),
        speculative_config=run.get("speculative_config"),
        seed=0,
        disable_log_stats=True,
    )


def drive(llm, workload: list[dict]) -> dict:
    """Requests arrive and are aborted at given engine steps; returns each request's tokens and finish,
    and `counts`: [engine step, tokens so far] at each step that delivered to it."""
    engine = llm.llm_engine
    pending = sorted(workload, key=lambda item: item.get("arrival", 0))
    aborts = {item["id"]: item["abort"] for item in workload if item.get("abort") is not None}
    results: dict[str, dict] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].get("arrival", 0) <= step:
            item = pending.pop(0)
            engine.add_request(item["id"], {"prompt_token_ids": item["prompt"]}, _params(item["params"]))
        due = [req_id for req_id, at in aborts.items() if at == step]
        if due:
            engine.abort_request(due)
            for req_id in due:  # an aborted request produces no final output: its tokens so far
                seen = results.setdefault(req_id, {"tokens": [], "finished": False})
                if not seen["finished"]:
                    seen.update(finish_reason="abort", finished=True)
        for out in engine.step():
            counts = results.get(out.request_id, {}).get("counts", [])
            counts.append([step, len(out.outputs[0].token_ids)])
            results[out.request_id] = {
                "counts": counts,
                "tokens": list(out.outputs[0].token_ids),
                "text": out.outputs[0].text,
                "finish_reason": out.outputs[0].finish_reason,
                "finished": out.finished,
                "logprobs": _logprobs(out.outputs[0].logprobs),
                "prompt_logprobs": _logprobs(out.prompt_logprobs),
            }
        step += 1
        if step > 10_000:
            raise RuntimeError("the workload did not finish in 10000 engine steps")
    return results


def case_runs(args: dict) -> dict:
    """Each run (an engine configuration) drives the workload (or its own) on a fresh engine, one after another;
    `refusals` (optional, case_refusals' arguments) are checked first, in the same process."""
    results = {}
    if "refusals" in args:
        results["refusals"] = case_refusals({"ckpt": args["ckpt"], **args["refusals"]})
    for run in args["runs"]:
        started = time.monotonic()
        llm = _engine(args["ckpt"], run)
        built = time.monotonic()
        outputs = drive(llm, run.get("workload") or args["workload"])
        stats = llm.collective_rpc("neuron_async_sm_stats")
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        results[run["name"]] = {
            "outputs": outputs,
            "stats": stats,
            "start_s": built - started,
            "run_s": time.monotonic() - built,
        }
    return results


def case_kill_rank(args: dict) -> dict:
    """One engine: requests running, then a rank's device process killed (SIGKILL); the engine goes on
    stepping until it fails. Returns the error the client saw and the ranks' device process ids."""
    import os
    import signal

    llm = _engine(args["ckpt"], args["run"])
    pids = [stats["device_pid"] for stats in llm.collective_rpc("neuron_async_sm_stats")]
    engine = llm.llm_engine
    for i in range(4):
        engine.add_request(f"r{i}", {"prompt_token_ids": [1, 5 + i, 6, 7]}, _params({"max_tokens": 48}))
    for _ in range(3):
        engine.step()  # mid-run: every request in flight
    os.kill(pids[args["rank"]], signal.SIGKILL)
    killed = time.monotonic()
    error = None
    try:
        while engine.has_unfinished_requests() and time.monotonic() - killed < 60:
            engine.step()
    except Exception as exc:  # vLLM's EngineDeadError: the engine core's own log has the cause
        error = f"{type(exc).__name__}: {exc}"
    return {"pids": pids, "error": error, "seconds": time.monotonic() - killed}


def case_refusals(args: dict) -> dict:
    """Each configuration built as vLLM builds it (`EngineArgs.create_engine_config`: our platform's
    check runs, no engine starts): the error it raised, or None. Then, after the last one (which must
    be accepted), `request`: what our platform's validate_request said of the request `args["request"]`."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    errors: dict[str, str | None] = {}
    for name, kwargs in args["configs"].items():
        try:
            EngineArgs(model=args["ckpt"], **kwargs).create_engine_config()
            errors[name] = None
        except Exception as exc:  # vLLM wraps some in its own types: the message is what counts
            errors[name] = f"{type(exc).__name__}: {exc}"
    try:
        current_platform.validate_request(None, _params(args["request"]))
        errors["request"] = None
    except ValueError as exc:
        errors["request"] = str(exc)
    return errors


CASES = {"platform": case_platform, "runs": case_runs, "kill_rank": case_kill_rank, "refusals": case_refusals}


if __name__ == "__main__":
    case, raw_args, out_path = sys.argv[1:4]
    result = CASES[case](json.loads(raw_args))
    with open(out_path, "w", encoding="utf-8") as out:
        json.dump(result, out)
