"""Our loader + StepProgram against transformers' LlamaForCausalLM on small random checkpoints.

And the whole engine (LLM in both modes, the CLI) on a checkpoint whose max_position_embeddings is
256, with no max_model_len given: the engine takes the model's limit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.reference import VOCAB, generate_alone, hf_greedy, save_hf_model

from neuron_async_sm import LLM, SamplingParams
from neuron_async_sm.model import ModelSpec, build_step_program, load_model_config

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ([1, 17, 33, 150, 9], [1, 5], [1, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111])
NEW_TOKENS = 12


def ours_greedy(path: Path, dtype: str) -> list[list[int]]:
    program = build_step_program(ModelSpec(str(path), dtype, max_num_seqs=4, max_model_len=64))
    return [generate_alone(program, prompt, NEW_TOKENS, slot=i % 4) for i, prompt in enumerate(PROMPTS)]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_greedy_tokens_equal_transformers_generate(tmp_path: Path, dtype: str) -> None:
    model = save_hf_model(tmp_path)
    if dtype == "float64":
        model = model.double()
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    assert len({tuple(e) for e in expected}) == len(PROMPTS)  # the prompts really lead apart
    assert ours_greedy(tmp_path, dtype) == expected


def test_tied_embeddings_checkpoint_matches(tmp_path: Path) -> None:
    model = save_hf_model(tmp_path, tie_word_embeddings=True, seed=1)
    assert load_model_config(str(tmp_path)).tie_word_embeddings
    assert ours_greedy(tmp_path, "float32") == [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]


def test_pytorch_model_bin_checkpoint_matches(tmp_path: Path) -> None:
    """Legacy layout: pytorch_model.bin (torch.save'd state dict) instead of safetensors."""
    model = save_hf_model(tmp_path, seed=2)
    (tmp_path / "model.safetensors").unlink()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    assert ours_greedy(tmp_path, "float32") == [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]


def test_sharded_safetensors_checkpoint_matches(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = save_hf_model(tmp_path / "whole", seed=3)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="60KB")
    assert len(list((tmp_path / "sharded").glob("model-*-of-*.safetensors"))) > 1
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert ours_greedy(tmp_path / "sharded", "float32") == [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]


def test_llama3_rope_scaling_logits_match(tmp_path: Path) -> None:
    """Positions run past original_max_position_embeddings, where llama3 scaling changes low frequencies."""
    rope = dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8,
    )
    model = save_hf_model(
        tmp_path, head_dim=32, num_attention_heads=2, num_key_value_heads=1, rope_parameters=rope, seed=4
    )
    assert load_model_config(str(tmp_path)).rope_scaling is not None
    program = build_step_program(ModelSpec(str(tmp_path), "float64", max_num_seqs=1, max_model_len=64))
    prompt = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model.double()(prompt).logits[0, -1]
    ours = program.forward_logits(
        input_ids=prompt.int(),
        positions=torch.arange(40, dtype=torch.int32)[None],
        query_lens=torch.tensor([40], dtype=torch.int32),
        slot_ids=torch.tensor([0], dtype=torch.int32),
    )[0]
    # HF computes RoPE angles in float32 even for a float64 model, hence not 1e-12.
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_engine_takes_max_model_len_from_the_checkpoint_and_matches_transformers(
    tmp_path: Path, async_scheduling: bool
) -> None:
    model = save_hf_model(tmp_path, seed=5)
    assert load_model_config(str(tmp_path)).max_position_embeddings == 256  # below the old default 512
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    with LLM(str(tmp_path), device="cpu-inprocess", async_scheduling=async_scheduling) as llm:
        assert llm.config.max_model_len == 256
        outputs = llm.generate([list(p) for p in PROMPTS], SamplingParams(max_tokens=NEW_TOKENS))
    assert [o.output_token_ids for o in outputs] == expected


def test_cli_generates_from_the_checkpoint_without_max_model_len(tmp_path: Path) -> None:
    """`neuron-async-sm generate --model <dir>` with the default device process and no --max-model-len."""
    model = save_hf_model(tmp_path / "model", seed=6)
    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"request_id": f"r{i}", "prompt_token_ids": p, "max_tokens": NEW_TOKENS} for i, p in enumerate(PROMPTS)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "neuron_async_sm",
            "--verbose",
            "generate",
            "--model",
            str(tmp_path / "model"),
            "--prompts",
            str(prompts),
            "--output",
            str(out),
            "--no-progress",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "max_model_len=256 (the model's max_position_embeddings)" in proc.stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["output_token_ids"] for r in results] == [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
