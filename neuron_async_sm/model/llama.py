"""The Llama decoder forward pass over a slot-indexed KV cache (plain tensors, no nn.Module)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from neuron_async_sm.model.config import LlamaConfig
from neuron_async_sm.model.kv_cache import KVCache
from neuron_async_sm.model.packed import PackedBatch
from neuron_async_sm.model.rope import RopeTable, apply_rope


@torch.library.custom_op("neuron_async_sm::cached_attention", mutates_args=("k_cache", "v_cache"))
def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    write_slots: torch.Tensor,
    positions: torch.Tensor,
    slot_ids: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The compiled program's attention, one opaque op: write k/v `[B, L, kv, D]` into one layer's
    cache `[slots, max_model_len, kv, D]`, attend q `[B, L, heads, D]` to each row's slot; `[B, L, heads, D]`.

    Opaque to torch.compile on purpose: traced, the in-place cache write becomes a copy of the whole
    layer's cache per step (functionalization; 10x slower than eager), and the attended prefix
    (`context_len`, a value read from `positions`) would make every context length its own program.
    Here both stay as eager runs them, and the compiled graph is one per input shape.
    """
    max_len, heads_dim = k_cache.shape[1], k.shape[-2:]
    flat = (write_slots * max_len + positions).reshape(-1)  # [B * L]
    k_cache.view(-1, *heads_dim).index_copy_(0, flat, k.reshape(-1, *heads_dim))
    v_cache.view(-1, *heads_dim).index_copy_(0, flat, v.reshape(-1, *heads_dim))
    context_len = int(positions.max()) + 1
    keys = k_cache[:, :context_len].index_select(0, slot_ids)  # [B, T, kv, D]
    values = v_cache[:, :context_len].index_select(0, slot_ids)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=causal_mask(positions, context_len),
        scale=scale,
        enable_gqa=True,
    )  # [B, heads, L, D]
    return out.transpose(1, 2).contiguous()


@cached_attention.register_fake
def _(q, k, v, k_cache, v_cache, write_slots, positions, slot_ids, scale):  # noqa: ANN001, ANN202
    return torch.empty_like(q)


def causal_mask(positions: torch.Tensor, context_len: int) -> torch.Tensor:
    """Bool `[B, 1, L, T]`: key position t is visible to query (b, j) iff t <= positions[b, j].

    Causal within the chunk (the chunk's own K/V are written before the read) and blind to stale
    entries past the row's end. Position 0 is always visible, so no query row is fully masked (NaN).
    """
    key_pos = torch.arange(context_len, device=positions.device)
    return (key_pos.view(1, 1, -1) <= positions.unsqueeze(-1)).unsqueeze(1)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer. q/k/v and gate/up are fused so each layer runs two GEMMs where HF runs five."""

    input_norm: torch.Tensor  # [hidden]
    qkv_proj: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]: rows are q, then k, then v
    o_proj: torch.Tensor  # [hidden, heads * head_dim]
    post_attention_norm: torch.Tensor  # [hidden]
    gate_up_proj: torch.Tensor  # [2 * intermediate, hidden]: rows are gate, then up
    down_proj: torch.Tensor  # [hidden, intermediate]


@dataclass(frozen=True)
class DenseLayer:
    """One layer as the forward uses it: the matrices transposed to `[in, out]`, contiguous.

    A projection is then `x @ w`, which on CPU runs 1.1-2x faster than `F.linear(x, w_out_in)`
    (batch 64 to 1; measured on tiny-llama's shapes, 1 thread), the same product.
    """

    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [hidden, (heads + 2 * kv_heads) * head_dim]
    o: torch.Tensor  # [heads * head_dim, hidden]
    post_attention_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [hidden, 2 * intermediate]
    down: torch.Tensor  # [intermediate, hidden]

    @staticmethod
    def of(layer: LayerWeights) -> DenseLayer:
        def t(w: torch.Tensor) -> torch.Tensor:
            return w.t().contiguous()

        return DenseLayer(
            layer.input_norm,
            t(layer.qkv_proj),
            t(layer.o_proj),
            layer.post_attention_norm,
            t(layer.gate_up_proj),
            t(layer.down_proj),
        )


@dataclass(frozen=True)
class LlamaWeights:
    """All weights of a LlamaForCausalLM in the model dtype."""

    embed_tokens: torch.Tensor  # [vocab, hidden]
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the same tensor as embed_tokens when tied

    def to(self, device: torch.device) -> LlamaWeights:
        """The same weights on `device` (a tied lm_head stays one tensor with embed_tokens)."""
        embed = self.embed_tokens.to(device)
        layers = tuple(
            LayerWeights(*(getattr(layer, f.name).to(device) for f in dataclasses.fields(LayerWeights)))
            for layer in self.layers
        )
        lm_head = embed if self.lm_head is self.embed_tokens else self.lm_head.to(device)
        return LlamaWeights(embed, layers, self.norm.to(device), lm_head)


@dataclass(frozen=True)
class ForwardBatch:
    """One step's tokens, already sanitized: padding tokens carry id 0 and position 0."""

    input_ids: torch.Tensor  # [B, L] int64
    positions: torch.Tensor  # [B, L] int64
    write_slots: torch.Tensor  # [B, L] int64: the row's slot for valid tokens, the scratch slot otherwise
    slot_ids: torch.Tensor  # [B] int64: slot each row's queries read from
    last_index: torch.Tensor  # [B] int64: index of the row's last valid token (0 for padding rows)
    context_len: int  # max valid position + 1: attention reads only this cache prefix


def compute_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """Precision of norms, softmax and logits: float64 models stay float64, everything else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class LlamaModel:
    """Llama decoder: embeddings, `num_hidden_layers` pre-norm blocks (GQA attention + SwiGLU), norm, lm_head.

    Every op is row-local (no cross-row reduction), so a row's result does not depend on which other
    rows share its batch beyond floating-point GEMM blocking. `opaque_attention` (set for a compiled
    program) runs each layer's cache write and attention as the one op `cached_attention`.
    """

    def __init__(self, config: LlamaConfig, weights: LlamaWeights, max_model_len: int, dtype: torch.dtype):
        self.opaque_attention = False
        self.config = config
        # The layers' matrices live only transposed (`DenseLayer`); the [out, in] ones are dropped.
        self.layers = tuple(DenseLayer.of(layer) for layer in weights.layers)
        self.weights = dataclasses.replace(weights, layers=())
        tied = weights.lm_head is weights.embed_tokens  # tied: no second copy of the embedding
        self.lm_head_t = None if tied else weights.lm_head.t().contiguous()  # [hidden, vocab]
        self.rope = RopeTable.build(config, max_model_len, dtype).to(weights.embed_tokens.device)
        self.compute_dtype = compute_dtype_for(dtype)
        self.scale = config.head_dim**-0.5
        # F.rms_norm where it is one host op; XLA traces the plain ops (as HF writes them) instead.
        self.fused_norm = weights.embed_tokens.device.type != "xla"

    def forward(self, batch: ForwardBatch | PackedBatch, cache: KVCache) -> torch.Tensor:
        """Writes the batch's K/V into `cache`; returns logits `[B, vocab]` of each row's last valid token."""
        if isinstance(batch, PackedBatch):
            return self._forward_packed(batch, cache)
        hidden = self.hidden_states(batch, cache)  # [B, L, hidden]
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return self.logits_of(hidden[rows, batch.last_index])  # [B, vocab]: lm_head only on last tokens

    def forward_every_token(
        self, batch: ForwardBatch | PackedBatch, cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, and the logits of every token too (prompt logprobs): (`[B, vocab]` as `forward`
        gives them, `[B, L, vocab]` padded or `[N, vocab]` packed). The last tokens' logits go through
        the same ops as in `forward`, so a row samples the same token whether or not it asks for these."""
        if isinstance(batch, PackedBatch) and batch.input_ids.numel() == 0:
            empty = self._forward_packed(batch, cache)
            return empty, empty[:0]
        hidden = self.hidden_states(batch, cache)  # [B, L, hidden] or [N, hidden]
        if isinstance(batch, PackedBatch):
            last = hidden if batch.last_token is None else hidden[batch.last_token]
        else:
            last = hidden[torch.arange(hidden.shape[0], device=hidden.device), batch.last_index]
        return self.logits_of(last), self.logits_of(hidden)

    def hidden_states(self, batch: ForwardBatch | PackedBatch, cache: KVCache) -> torch.Tensor:
        """Writes the batch's K/V into `cache`; the last layer's output for every token, before the final
        norm: `[B, L, hidden]`, or `[N, hidden]` for a packed batch (speculative verification reads
        several tokens of a row, model/spec_decode.py)."""
        w = self.weights
        packed = isinstance(batch, PackedBatch)
        hidden = F.embedding(batch.input_ids, w.embed_tokens)  # [B, L, hidden] or [N, hidden]
        rope = self.rope.lookup(batch.positions)
        mask = None
        if not packed and not self.opaque_attention:
            mask = causal_mask(batch.positions, batch.context_len)  # [B, 1, L, T]
        for index, layer in enumerate(self.layers):
            attn_in = self._norm(hidden, layer.input_norm)
            hidden = hidden + self._attention(index, layer, attn_in, batch, rope, mask, cache)
            hidden = hidden + self._mlp(layer, self._norm(hidden, layer.post_attention_norm))
        return hidden

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits `[..., vocab]` of last-layer hidden states `[..., hidden]`: the final norm, then lm_head."""
        return self._logits(self._norm(hidden, self.weights.norm))

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        """Logits `[B, vocab]` in the compute dtype of the last tokens' hidden states `[B, hidden]`."""
        logits = F.linear(last, self.weights.lm_head) if self.lm_head_t is None else last @ self.lm_head_t
        return logits.to(self.compute_dtype)

    def _forward_packed(self, batch: PackedBatch, cache: KVCache) -> torch.Tensor:
        """`forward` on the packed tokens `[N]` (see model/packed.py); logits `[B, vocab]`."""
        w = self.weights
        if batch.input_ids.numel() == 0:  # an all-padding step: nothing to write or attend
            return torch.zeros(batch.rows, w.lm_head.shape[0], dtype=self.compute_dtype, device=w.lm_head.device)
        hidden = self.hidden_states(batch, cache)  # [N, hidden]
        last = hidden if batch.last_token is None else hidden[batch.last_token]  # [B, hidden]
        return self.logits_of(last)  # [B, vocab]

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.fused_norm and x.dtype == self.compute_dtype:  # one op, the same arithmetic
            return F.rms_norm(x, weight.shape, weight, self.config.rms_norm_eps)
        xc = x.to(self.compute_dtype)
        xc = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xc.to(x.dtype)

    def _attention(
        self,
        index: int,
        layer: DenseLayer,
        x: torch.Tensor,
        batch: ForwardBatch | PackedBatch,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: KVCache,
    ) -> torch.Tensor:
        if isinstance(batch, PackedBatch):
            return self._packed_attention(index, layer, x, batch, rope, cache)
        cfg = self.config
        b, length, _ = x.shape
        kv, heads, dim = cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim
        q, k, v = (x @ layer.qkv).split([heads * dim, kv * dim, kv * dim], dim=-1)
        q = apply_rope(q.view(b, length, heads, dim), *rope)  # [B, L, heads, D]
        k = apply_rope(k.view(b, length, kv, dim), *rope)  # [B, L, kv, D]
        v = v.view(b, length, kv, dim)
        if self.opaque_attention:  # compiled: the cache write and attention as one op (mask unused)
            out = cached_attention(
                q, k, v, cache.k[index], cache.v[index], batch.write_slots, batch.positions, batch.slot_ids, self.scale
            )
            return out.reshape(b, length, heads * dim) @ layer.o
        # Padding tokens go to the scratch slot (batch.write_slots): writing them at their row's
        # slot, position 0, would overwrite a live request's first token.
        cache.write(index, batch.write_slots, batch.positions, k, v)
        keys, values = cache.read(index, batch.slot_ids, batch.context_len)  # [B, T, kv, D]
        # enable_gqa: query head h reads kv head h // (heads // kv), HF's repeat_kv order.
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=True,
        )  # [B, heads, L, D]
        return out.transpose(1, 2).reshape(b, length, heads * dim) @ layer.o

    def _packed_attention(
        self,
        index: int,
        layer: DenseLayer,
        x: torch.Tensor,
        batch: PackedBatch,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache,
    ) -> torch.Tensor:
        """Attention of the packed tokens x `[N, hidden]`, group by group (model/packed.py)."""
        cfg = self.config
        n = x.shape[0]
        kv, heads, dim = cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim
        qkv = (x @ layer.qkv).view(n, heads + 2 * kv, dim)
        # q and k rotated in one pass (the same cos/sin per token): [N, heads + kv, D]
        q, k = apply_rope(qkv[:, : heads + kv], *rope).split([heads, kv], dim=1)
        cache.write_at(index, batch.write_index, k, qkv[:, heads + kv :])
        out = None
        for g in batch.groups:
            gq = q if g.query_index is None else q.index_select(0, g.query_index)  # [R * Lg, heads, D]
            if g.window_start is None:
                keys, values = cache.read(index, g.slot_ids, g.context_len)  # type: ignore[arg-type]
            else:  # the rows' slots lie together: the cache window itself, no copy
                window = slice(g.window_start, g.window_start + g.rows)
                keys, values = cache.k[index, window, : g.context_len], cache.v[index, window, : g.context_len]
            # One query per row: kv head j's query heads (HF's repeat_kv order: h // group) attend as
            # j's queries, [R, kv, group, D], 25-35% faster on CPU than enable_gqa's one head at a time;
            # a chunk's rows attend [R, heads, Lg, D] with enable_gqa.
            one = g.query_len == 1
            queries = gq.view(g.rows, kv, heads // kv, dim) if one else gq.view(g.rows, -1, heads, dim).transpose(1, 2)
            result = F.scaled_dot_product_attention(
                queries,
                keys.transpose(1, 2),
                values.transpose(1, 2),
                attn_mask=g.mask,
                scale=self.scale,
                enable_gqa=not one,
            )
            result = result.view(g.rows, heads, dim) if one else result.transpose(1, 2).reshape(-1, heads, dim)
            if g.result_rows is None:  # the one group, all tokens in order
                out = result
                continue
            if out is None:
                out = q.new_empty(n, heads, dim)
            out.index_copy_(0, g.result_tokens, result.index_select(0, g.result_rows))  # type: ignore[arg-type]
        assert out is not None
        return out.reshape(n, heads * dim) @ layer.o

    def _mlp(self, layer: DenseLayer, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ layer.gate_up).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ layer.down
