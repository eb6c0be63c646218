"""Tensor-parallel sharding of a loaded Llama-style model, Megatron style, before anything packs it.

Each rank keeps whole groups of query heads that share one KV head (column-parallel Q, K, V),
its slice of the MLP's intermediate features (column-parallel gate and up) and the matching
input columns of ``o_proj`` and ``down_proj`` (row-parallel: every rank's partial output is
summed by one all-reduce), plus a slice of the vocabulary rows of ``lm_head`` (its logits are
gathered to rank 0). The input embedding and the norms stay whole on every rank.

Groups are dealt out as evenly as they go (9 heads in 3 KV groups over 2 ranks: 6 + 3 heads);
with fewer KV heads than ranks, each KV head is replicated on ``ranks / kv_heads`` ranks that
split its query heads, which needs both divisions to be exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llmserve import ConfigError

ARCHITECTURES = ("llama", "mistral", "qwen2")  # what the fused forward runs (fused._ARCHITECTURES)


def split(total: int, world: int, rank: int) -> tuple[int, int]:
    """``rank``'s ``[start, stop)`` of ``total`` items dealt as evenly as possible (first ranks get the extra)."""
    base, extra = divmod(total, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class HeadShard:
    """One rank's query heads ``[q0, q1)`` and KV heads ``[kv0, kv1)``."""

    q0: int
    q1: int
    kv0: int
    kv1: int

    @property
    def heads(self) -> int:
        return self.q1 - self.q0

    @property
    def kv_heads(self) -> int:
        return self.kv1 - self.kv0


def _fits(heads: int, kv_heads: int, world: int) -> bool:
    if world <= kv_heads:
        return True
    group = heads // kv_heads
    return world % kv_heads == 0 and group % (world // kv_heads) == 0


def head_shard(heads: int, kv_heads: int, world: int, rank: int, model: str = "the model") -> HeadShard:
    """Rank ``rank``'s heads, or a one-line ConfigError when ``world`` cannot split them."""
    if heads % kv_heads:
        raise ConfigError(f"{model} has {heads} attention heads in {kv_heads} KV heads, which do not group evenly")
    if not _fits(heads, kv_heads, world):
        sizes = [n for n in range(1, 65) if _fits(heads, kv_heads, n)]
        shown = ", ".join(str(n) for n in sizes[:12])
        raise ConfigError(f"--tensor-parallel-size {world} cannot split {model}'s {heads} attention heads "
                          f"({kv_heads} KV heads) across ranks: use one of {shown}")
    group = heads // kv_heads
    if world <= kv_heads:
        kv0, kv1 = split(kv_heads, world, rank)
        return HeadShard(kv0 * group, kv1 * group, kv0, kv1)
    per_kv = world // kv_heads  # ranks sharing one replicated KV head
    kv = rank // per_kv
    q0, q1 = split(group, per_kv, rank % per_kv)
    return HeadShard(kv * group + q0, kv * group + q1, kv, kv + 1)


def text_config(model_config: Any) -> Any:
    return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config


def check(cfg: Any, world: int, model: str = "the model") -> None:
    """Refuse (ConfigError) a model ``world`` ranks cannot split, before anything is started."""
    kind = getattr(cfg, "model_type", None)
    if kind not in ARCHITECTURES or getattr(cfg, "hidden_act", None) != "silu":
        raise ConfigError(f"--tensor-parallel-size {world}: {model} is a '{kind}' model; tensor parallel runs "
                          f"the Llama-style decoders of the fused forward ({', '.join(ARCHITECTURES)})")
    heads = int(cfg.num_attention_heads)
    head_shard(heads, int(getattr(cfg, "num_key_value_heads", None) or heads), world, 0, model)
    if int(cfg.intermediate_size) < world:
        raise ConfigError(f"--tensor-parallel-size {world} exceeds {model}'s {cfg.intermediate_size} MLP features")


def _keep(linear: torch.nn.Linear, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None,
          bias: bool = True) -> None:
    """Replace ``linear``'s weight by its ``rows`` (output) or ``cols`` (input) slice, a copy, so
    the whole matrix is freed; ``bias=False`` zeroes the bias (a row-parallel layer adds it on one rank)."""
    w = linear.weight.data
    if rows is not None:
        w = w[rows[0]:rows[1]]
    if cols is not None:
        w = w[:, cols[0]:cols[1]]
    linear.weight = torch.nn.Parameter(w.contiguous().clone(), requires_grad=False)
    linear.out_features, linear.in_features = linear.weight.shape
    if linear.bias is not None:
        b = linear.bias.data[rows[0]:rows[1]] if rows is not None else linear.bias.data
        b = b.clone() if bias else torch.zeros_like(b)
        linear.bias = torch.nn.Parameter(b, requires_grad=False)


def shard_model(model: Any, world: int, rank: int) -> HeadShard:
    """Keep ``rank``'s shard of ``model`` in place (the input embedding stays whole); returns its heads."""
    cfg = text_config(model.config)
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    shard = head_shard(heads, kv_heads, world, rank)
    q, kv = (shard.q0 * dim, shard.q1 * dim), (shard.kv0 * dim, shard.kv1 * dim)
    feat = split(int(cfg.intermediate_size), world, rank)
    for layer in model.get_decoder().layers:
        attn, mlp = layer.self_attn, layer.mlp
        _keep(attn.q_proj, rows=q)
        _keep(attn.k_proj, rows=kv)
        _keep(attn.v_proj, rows=kv)
        _keep(attn.o_proj, cols=q, bias=rank == 0)
        _keep(mlp.gate_proj, rows=feat)
        _keep(mlp.up_proj, rows=feat)
        _keep(mlp.down_proj, cols=feat, bias=rank == 0)
    # Vocabulary-parallel head: equal slices (the last padded with zero rows) so the gather is
    # one fixed-size collective; a new module, since the weight is often tied to the embedding.
    head = model.get_output_embeddings()
    vocab, hidden = head.weight.shape
    per = -(-vocab // world)
    start, stop = min(rank * per, vocab), min((rank + 1) * per, vocab)
    weight = torch.zeros(per, hidden, dtype=head.weight.dtype, device=head.weight.device)
    weight[:stop - start] = head.weight.data[start:stop]
    sliced = torch.nn.Linear(hidden, per, bias=head.bias is not None, dtype=weight.dtype, device=weight.device)
    sliced.weight = torch.nn.Parameter(weight, requires_grad=False)
    if head.bias is not None:
        bias = torch.zeros(per, dtype=head.bias.dtype, device=head.bias.device)
        bias[:stop - start] = head.bias.data[start:stop]
        sliced.bias = torch.nn.Parameter(bias, requires_grad=False)
    model.set_output_embeddings(sliced)
    return shard
