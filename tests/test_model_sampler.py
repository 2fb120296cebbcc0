"""sample_tokens: greedy, filters, and counter-based randomness independent of batch and position."""

from __future__ import annotations

import torch

from neuron_async_sm.model import sample_tokens
from neuron_async_sm.model.sampler import splitmix64, uniform_noise

VOCAB = 50


def logits_rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def sample(logits: torch.Tensor, temperature=1.0, top_k=0, top_p=1.0, seeds=0, output_index=0) -> torch.Tensor:
    n = logits.shape[0]

    def col(value, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(value, dtype=dtype).expand(n).clone()

    return sample_tokens(
        logits,
        temperature=col(temperature, torch.float32),
        top_k=col(top_k, torch.int32),
        top_p=col(top_p, torch.float32),
        seeds=col(seeds, torch.int64),
        output_index=col(output_index, torch.int64),
    )


def test_splitmix64_matches_python_reference() -> None:
    def reference(x: int) -> int:
        mask = (1 << 64) - 1
        z = (x + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    inputs = [0, 1, 12345, -1, -(1 << 63), (1 << 63) - 1]
    got = splitmix64(torch.tensor(inputs, dtype=torch.int64)).tolist()
    assert [g & ((1 << 64) - 1) for g in got] == [reference(x & ((1 << 64) - 1)) for x in inputs]


def test_noise_is_strictly_inside_unit_interval_and_keyed_by_seed_and_index() -> None:
    u = uniform_noise(torch.tensor([0, 0, 1]), torch.tensor([0, 1, 0]), 1000)
    assert bool(((u > 0) & (u < 1)).all())
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert abs(float(u.mean()) - 0.5) < 0.02


def test_temperature_zero_is_argmax() -> None:
    logits = logits_rows(16)
    assert torch.equal(sample(logits, temperature=0.0, seeds=torch.arange(16)), logits.argmax(-1))


def test_top_k_1_and_tiny_top_p_are_greedy() -> None:
    logits = logits_rows(16, seed=1)
    seeds = torch.arange(16)
    assert torch.equal(sample(logits, temperature=1.5, top_k=1, seeds=seeds), logits.argmax(-1))
    assert torch.equal(sample(logits, temperature=1.5, top_p=1e-6, seeds=seeds), logits.argmax(-1))


def test_top_k_and_top_p_keep_only_their_sets() -> None:
    logits = (logits_rows(1, seed=2) / 4).expand(400, VOCAB)  # flat enough for a multi-token nucleus
    index = torch.arange(400)
    ranked = logits[0].argsort(descending=True).tolist()
    top5 = set(sample(logits, top_k=5, output_index=index).tolist())
    assert top5 == set(ranked[:5])
    probs = torch.softmax(logits[0].double(), -1)[ranked]
    nucleus_size = int((probs.cumsum(0) - probs < 0.5).sum())
    nucleus = set(sample(logits, top_p=0.5, output_index=index).tolist())
    assert nucleus == set(ranked[:nucleus_size]) and 1 < nucleus_size < VOCAB // 2


def test_same_seed_and_index_give_same_token_whatever_the_batch() -> None:
    target = logits_rows(1, seed=3)
    alone = [int(sample(target, seeds=7, output_index=i)[0]) for i in range(30)]
    for i in range(30):
        others = logits_rows(5, seed=100 + i)
        batch = torch.cat([others[: i % 5], target, others[i % 5 :]])
        seeds = torch.tensor([90 + j for j in range(6)])
        seeds[i % 5] = 7
        index = torch.randint(0, 50, (6,), generator=torch.Generator().manual_seed(i))
        index[i % 5] = i
        temperature = torch.tensor([0.0, 0.5, 1.0, 2.0, 1.0, 0.7])
        temperature[i % 5] = 1.0
        top_k = torch.tensor([0, 3, 0, 10, 0, 0], dtype=torch.int32)
        top_k[i % 5] = 0
        got = sample_tokens(
            batch, temperature=temperature, top_k=top_k, top_p=torch.full((6,), 0.95), seeds=seeds, output_index=index
        )[i % 5]
        alone_with_top_p = int(sample(target, top_p=0.95, seeds=7, output_index=i)[0])
        assert int(got) == alone_with_top_p
    assert len(set(alone)) > 3  # the index really moves the sample


def test_different_seeds_sample_differently() -> None:
    logits = logits_rows(1, seed=4).expand(200, VOCAB)
    a = sample(logits, seeds=1, output_index=torch.arange(200))
    b = sample(logits, seeds=2, output_index=torch.arange(200))
    assert (a != b).float().mean() > 0.5


def test_frequencies_follow_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    draws = 20000
    temperature = 0.8
    tokens = sample(logits.expand(draws, 5), temperature=temperature, seeds=42, output_index=torch.arange(draws))
    freq = torch.bincount(tokens, minlength=5).double() / draws
    expected = torch.softmax(logits[0].double() / temperature, -1)
    # 4 sigma of a binomial proportion at p <= 0.5, n = 20000 is about 0.014.
    torch.testing.assert_close(freq, expected, rtol=0, atol=0.015)
