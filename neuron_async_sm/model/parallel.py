"""Tensor parallelism inside a device process: the sharding rules, the collectives, the sharded program.

Each rank of a tensor-parallel group is one device process that loads the whole checkpoint and
keeps its slices (Megatron-style):

- q/k/v and gate/up are column-parallel: rank r keeps its attention heads (and their KV heads) and
  its slice of the intermediate size, so attention and the SwiGLU run on local heads and columns;
- o and down are row-parallel: each rank's product is a partial sum, completed by an all-reduce;
- the LM head is vocab-parallel: rank r computes logits for its slice of the vocabulary, gathered
  (all-gather) before sampling, so every rank samples from the same full logits;
- norms and the embedding are replicated; the KV cache holds only the rank's KV heads.

Sampling is a pure function of (logits, seed, index) (`sampler.py`), so every rank samples the same
tokens and keeps its own sampled-token future. The output rank (group rank 0) is the only one whose
CPU token state is written back; the others' host-built input ids past the prompt are placeholders,
so each step's input ids are broadcast from rank 0 on the device before the embedding: every rank
computes on the output rank's ids (see docs/design.md, "Tensor parallelism").
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from neuron_async_sm.model.config import LlamaConfig, load_model_config
from neuron_async_sm.model.kv_cache import KVCache
from neuron_async_sm.model.llama import DenseLayer, ForwardBatch, LayerWeights, LlamaModel, LlamaWeights
from neuron_async_sm.model.loader import load_weights
from neuron_async_sm.model.packed import PackedBatch
from neuron_async_sm.model.program import HOST, StepProgram
from neuron_async_sm.model.spec import ModelSpec

SOURCE_RANK = 0
"""The group rank whose input ids every rank computes on: the output rank (the design's TP0)."""


@dataclass(frozen=True)
class TensorParallelGroup:
    """How one rank joins its group: plain fields, pickled into the device process.

    `timeout_s` bounds the rendezvous and every collective: a peer that never arrives, or one that
    stops taking part (a program failed on it, it hangs), ends the waiting rank's program with an
    error after this long instead of blocking it forever. A peer that dies closes its sockets,
    which gloo reports at once.
    """

    rank: int
    world_size: int
    port: int  # the rendezvous port on 127.0.0.1 (rank 0 listens on it)
    timeout_s: float
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"TensorParallelGroup.rank must lie in [0, {self.world_size}), got {self.rank}")
        if not self.timeout_s > 0:
            raise ValueError(f"TensorParallelGroup.timeout_s must be > 0, got {self.timeout_s}")

    def join(self) -> None:
        """Rendezvous with the other ranks (blocks until all arrived, at most `timeout_s`)."""
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a process group")
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{self.host}:{self.port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=self.timeout_s),
        )


def check_divisible(config: LlamaConfig, world_size: int) -> str | None:
    """What keeps `config` from splitting over `world_size` ranks, or None when it splits."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name)
        if value % world_size:
            return f"the model's {name} ({value}) does not divide by {world_size}"
    return None


def local_config(config: LlamaConfig, world_size: int) -> LlamaConfig:
    """The shapes one rank computes with: its heads, KV heads and intermediate columns."""
    problem = check_divisible(config, world_size)
    if problem is not None:
        raise ValueError(f"tensor_parallel_size={world_size}: {problem}")
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // world_size,
        num_key_value_heads=config.num_key_value_heads // world_size,
        intermediate_size=config.intermediate_size // world_size,
    )


def vocab_shard_size(vocab_size: int, world_size: int) -> int:
    """Rows of the LM head per rank: the vocabulary split evenly, the last shard padded with zero rows."""
    return -(-vocab_size // world_size)


def shard_weights(weights: LlamaWeights, config: LlamaConfig, rank: int, world_size: int) -> LlamaWeights:
    """Rank `rank`'s slices of the full weights (copies, so the full tensors can be freed)."""
    local = local_config(config, world_size)
    d = config.head_dim
    heads, kv, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    q_rows, kv_rows, i_cols = local.num_attention_heads * d, local.num_key_value_heads * d, local.intermediate_size

    def part(tensor: torch.Tensor, size: int, dim: int = 0) -> torch.Tensor:
        return tensor.narrow(dim, rank * size, size)

    def layer(w: LayerWeights) -> LayerWeights:
        q, k, v = w.qkv_proj.split([heads * d, kv * d, kv * d])
        gate, up = w.gate_up_proj.split([inter, inter])
        # Query head h of this rank reads KV head h // (heads // kv) of this rank: the group size is
        # the same on every rank, so HF's repeat_kv order holds locally.
        return LayerWeights(
            input_norm=w.input_norm.clone(),
            qkv_proj=torch.cat([part(q, q_rows), part(k, kv_rows), part(v, kv_rows)]).contiguous(),
            o_proj=part(w.o_proj, q_rows, dim=1).contiguous(),
            post_attention_norm=w.post_attention_norm.clone(),
            gate_up_proj=torch.cat([part(gate, i_cols), part(up, i_cols)]).contiguous(),
            down_proj=part(w.down_proj, i_cols, dim=1).contiguous(),
        )

    per = vocab_shard_size(config.vocab_size, world_size)
    head = weights.lm_head[rank * per : (rank + 1) * per]
    lm_head = torch.cat([head, head.new_zeros(per - head.shape[0], head.shape[1])]).contiguous()  # [per, hidden]
    return LlamaWeights(
        embed_tokens=weights.embed_tokens.clone(),
        layers=tuple(layer(w) for w in weights.layers),
        norm=weights.norm.clone(),
        lm_head=lm_head,
    )


class ShardedLlamaModel(LlamaModel):
    """`LlamaModel` over one rank's shard: all-reduces after o and down, all-gathers the logits."""

    def __init__(self, config: LlamaConfig, weights: LlamaWeights, max_model_len: int, dtype: torch.dtype):
        super().__init__(config, weights, max_model_len, dtype)
        self.vocab_size = config.vocab_size

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        # Every path to logits ends here (forward, every token, speculative verification's picks).
        return self._gather(super().logits_of(hidden))

    def _forward_packed(self, batch: PackedBatch, cache: KVCache) -> torch.Tensor:
        if batch.input_ids.numel() == 0:  # all padding on every rank (they share the shape): no logits_of
            return torch.zeros(batch.rows, self.vocab_size, dtype=self.compute_dtype, device=self.weights.norm.device)
        return super()._forward_packed(batch, cache)

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        """`[..., vocab / world]`, this rank's slice of the vocabulary, -> `[..., vocab]` on every rank."""
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]  # the padding columns' logits dropped

    def _attention(self, *args, **kwargs) -> torch.Tensor:
        out = super()._attention(*args, **kwargs)  # partial sum over this rank's heads
        dist.all_reduce(out)
        return out

    def _mlp(self, layer: DenseLayer, x: torch.Tensor) -> torch.Tensor:
        out = super()._mlp(layer, x)  # partial sum over this rank's intermediate columns
        dist.all_reduce(out)
        return out


class ShardedStepProgram(StepProgram):
    """A `StepProgram` on one rank: the same inputs and outputs, computed on the rank's shard.

    Every rank computes on the source rank's input ids (broadcast on the device): a non-output
    rank's host-built ids past the prompt are placeholders (its CPU token state is never written
    back), so they are not checked here and never reach the embedding.
    """

    def __init__(self, *args, rank: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rank = rank

    def _prepare(self, *args, **kwargs) -> ForwardBatch | PackedBatch:
        batch = super()._prepare(*args, **kwargs)
        # Hazard: stale input ids. A non-output rank's CPU state lacks every sampled token; the
        # output rank's ids (checked there) replace its own before anything reads them.
        dist.broadcast(batch.input_ids, src=SOURCE_RANK)
        return batch

    def _check(self, ids: torch.Tensor | None, *args) -> None:
        super()._check(ids if self.rank == SOURCE_RANK else None, *args)


def build_sharded_step_program(
    spec: ModelSpec, group: TensorParallelGroup, device: torch.device = HOST
) -> ShardedStepProgram:
    """Loads the checkpoint, keeps rank `group.rank`'s slices, allocates its KV cache, joins the group."""
    program = shard_step_program(spec, group.rank, group.world_size, device)
    # Joined last: a load that fails (the same checkpoint fails on every rank) is reported as that
    # error, and the rendezvous waits only out the ranks' difference in loading time.
    group.join()
    return program


def shard_step_program(spec: ModelSpec, rank: int, world_size: int, device: torch.device = HOST) -> ShardedStepProgram:
    """Rank `rank`'s program over `spec`'s model, split over `world_size` ranks, without joining a group:
    its collectives run in the group this process joined (a second model on the same ranks: the drafter)."""
    config = load_model_config(spec.model)
    if spec.max_model_len > config.max_position_embeddings:
        raise ValueError(
            f"ModelSpec.max_model_len ({spec.max_model_len}) exceeds the model's "
            f"max_position_embeddings ({config.max_position_embeddings})"
        )
    local = local_config(config, world_size)
    full = load_weights(spec.model, config, spec.torch_dtype, seed=spec.seed)
    weights = shard_weights(full, config, rank, world_size)
    del full
    if device.type != "cpu":
        weights = weights.to(device)
    model = ShardedLlamaModel(local, weights, spec.max_model_len, spec.torch_dtype)
    kv_cache = KVCache(local, spec.max_num_seqs, spec.max_model_len, spec.torch_dtype, device)
    return ShardedStepProgram(spec, config, model, kv_cache, device, rank=rank)
