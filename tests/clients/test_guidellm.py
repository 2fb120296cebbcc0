"""guidellm streams against `neuron-async-sm serve`: a short run (a few requests, synthetic prompts
made with the checkpoint's own tokenizer, nothing from the hub) on completions and on chat reports every
request successful, non-zero TTFT and ITL, and the token counts it asked for.

guidellm streams with `stream_options.continuous_usage_stats` and `ignore_eos` (a server that refused
them used to give all-zero tables and exit 0): its counts come from the usage in every chunk.
"""

from __future__ import annotations

import pytest
from support.clients_harness import guidellm_benchmark, needs

pytestmark = needs("guidellm")

REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 4, 8, 8


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_a_streaming_run_reports_ttft_and_itl_with_every_request_successful(server, checkpoint, endpoint, tmp_path):
    benchmark = guidellm_benchmark(
        server.url,
        server.model,
        str(checkpoint),
        endpoint,
        tmp_path,
        REQUESTS,
        prompt_tokens=PROMPT_TOKENS,
        output_tokens=OUTPUT_TOKENS,
    )
    metrics = benchmark["metrics"]
    assert metrics["request_totals"] == {"successful": REQUESTS, "errored": 0, "incomplete": 0, "total": REQUESTS}
    ttft, itl = metrics["time_to_first_token_ms"]["successful"], metrics["inter_token_latency_ms"]["successful"]
    print(f"\n{endpoint}: TTFT mean {ttft['mean']:.1f} ms, ITL mean {itl['mean']:.2f} ms")
    assert ttft["count"] == REQUESTS and ttft["min"] > 0
    assert itl["count"] == REQUESTS * (OUTPUT_TOKENS - 1) and itl["min"] > 0
    outputs = metrics["output_token_count"]["successful"]
    assert outputs["min"] == outputs["max"] == OUTPUT_TOKENS
    requests = benchmark["requests"]["successful"]
    assert all(r["info"]["status"] == "completed" and r["output"] for r in requests), requests
