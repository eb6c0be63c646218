"""The fused forward of Qwen3.5's (and Qwen3-Next's) hybrid decoder: three Gated DeltaNet layers to each gated
full-attention layer, every layer's projections fused into one product (and packed for the
native CPU kernels where they apply), the recurrent layers' token mixing in ``recurrent.mix``
over the step's state slots, the attention layers on the paged KV cache.

A full-attention layer projects queries, keys, values and the output gate in one product (the
checkpoint interleaves each head's query and gate rows; they are reordered once, at build, to
all queries, keys, values, then all gates), normalises each query and key head, rotates the first
quarter of each head (partial RoPE), attends, and scales the result by ``sigmoid(gate)``. A Gated
DeltaNet layer projects the convolution's input, the output gate and the two per-head scalars in
one product. Norms scale by ``(1 + weight)`` as Qwen3.5's do (added once here unless the weights
come from a file that stores the sum). Qwen3.5-MoE's and Qwen3-Next's layers end in
``moe.MoEFeedForward`` (routed experts and the shared one) where the dense model's end in one MLP;
Qwen3-Next's projections, grouped by key head in its checkpoint, are reordered once at build.

``HybridDecoder.build`` returns None for anything else (a dtype other than float32); the runner
then keeps transformers' forward with the recurrent layers replaced (``recurrent.install``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from .attention import PagedKVCache, StepMetadata, paged_attention
from .fused import Linear, TorchOps, _experts, _pack_experts, _packed, _TorchLinear, given_experts
from .moe import MoEFeedForward, SparseParts, moe_parts
from .recurrent import DeltaNetParams, mix

log = logging.getLogger("llmserve.backend.torch")

_TYPES = {"qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"}
_MLP_PARTS = {"gate_proj", "up_proj", "down_proj", "act_fn"}


class _HybridLayer:
    """One decoder layer: its norms and MLP, and either its attention (``delta`` None) or its
    Gated DeltaNet (``delta``: the parameters ``recurrent.mix`` reads)."""

    __slots__ = ("idx", "ln1", "ln2", "eps", "proj", "out", "gu", "down", "q_norm", "k_norm", "qk_eps",
                 "scaling", "delta", "moe")


def _cat(weights: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([w.detach() for w in weights]).contiguous()


def _ungrouped(m: Any) -> torch.Tensor:
    """Qwen3-Next's two input projections as one matrix in Qwen3.5's row order: every query, every
    key, every value, every gate, then ``b`` and ``a`` (its checkpoint keeps each key head's
    query, key, values and gates together, and each key head's ``b`` then ``a``)."""
    hk, dk, dv, r = int(m.num_k_heads), int(m.head_k_dim), int(m.head_v_dim), int(m.num_v_heads // m.num_k_heads)
    hidden = m.in_proj_qkvz.weight.shape[1]
    grouped = m.in_proj_qkvz.weight.detach().view(hk, 2 * dk + 2 * r * dv, hidden)
    qkvz = torch.split(grouped, [dk, dk, r * dv, r * dv], 1)
    ba = torch.split(m.in_proj_ba.weight.detach().view(hk, 2 * r, hidden), [r, r], 1)
    return torch.cat([part.reshape(-1, hidden) for part in (*qkvz, *ba)]).contiguous()


class HybridDecoder:
    """Runs a Qwen3.5 decoder stack over one packed step (``FusedDecoder``'s interface)."""

    reduce = None  # tensor parallel refuses hybrid models
    rope_table = None

    def __init__(self, model: Any, cfg: Any, pack: bool = False, ops: Any = None, compact: bool = True,
                 weights: Any = None) -> None:
        base = model.get_decoder()
        shift = not getattr(weights, "norms_shifted", False)

        def norm(module: Any) -> torch.Tensor:
            return (1.0 + module.weight.float()).contiguous() if shift else module.weight.float().contiguous()

        self.embed = weights.embed if weights is not None else base.embed_tokens
        self.rotary = base.rotary_emb
        self.norm_w, self.norm_eps = norm(base.norm), float(base.norm.eps)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads)
        self.ops = ops if ops is not None else TorchOps()
        self.layers: list[_HybridLayer] = []
        owners: list[tuple[_HybridLayer, dict[str, list[Any]]]] = []
        sparse_owners: list[tuple[MoEFeedForward, SparseParts]] = []
        H, D = self.heads, self.head_dim
        for i, dec in enumerate(base.layers):
            lay = _HybridLayer()
            lay.idx, lay.moe, lay.gu, lay.down = i, None, None, None
            sparse = moe_parts(dec.mlp)
            lay.ln1, lay.ln2 = norm(dec.input_layernorm), norm(dec.post_attention_layernorm)
            lay.eps = float(dec.input_layernorm.eps)
            given = weights.layers[i] if weights is not None else None
            if hasattr(dec, "linear_attn"):
                m = dec.linear_attn
                lay.delta = DeltaNetParams.of(m) if given is None else given["delta"]
                lay.q_norm = lay.k_norm = None
                lay.qk_eps = lay.scaling = 0.0
                if given is None and hasattr(m, "in_proj_qkvz"):  # Qwen3-Next: rows grouped by key head
                    parts = [m.in_proj_qkvz, m.in_proj_ba]
                    lay.proj = _TorchLinear(_ungrouped(m), None)
                    lay.out = _TorchLinear(m.out_proj.weight, None)
                    owners.append((lay, {"proj": parts, "out": [m.out_proj]}))
                elif given is None:
                    parts = [m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a]
                    lay.proj = _TorchLinear(_cat([p.weight for p in parts]), None)
                    lay.out = _TorchLinear(m.out_proj.weight, None)
                    owners.append((lay, {"proj": parts, "out": [m.out_proj]}))
            else:
                attn = dec.self_attn
                lay.delta = None
                lay.q_norm, lay.k_norm, lay.qk_eps = norm(attn.q_norm), norm(attn.k_norm), float(attn.q_norm.eps)
                lay.scaling = float(attn.scaling)
                if given is None:
                    # Each head's query rows, then its gate rows: all queries first, all gates last.
                    qg = attn.q_proj.weight.detach().view(H, 2, D, -1)
                    lay.proj = _TorchLinear(_cat([qg[:, 0].reshape(H * D, -1), attn.k_proj.weight,
                                                  attn.v_proj.weight, qg[:, 1].reshape(H * D, -1)]), None)
                    lay.out = _TorchLinear(attn.o_proj.weight, None)
                    owners.append((lay, {"proj": [attn.q_proj, attn.k_proj, attn.v_proj], "out": [attn.o_proj]}))
            if given is not None:
                lay.proj, lay.out = given["proj"], given["out"]
                if sparse is not None:
                    lay.moe = given_experts(given, sparse, self.ops.silu_mul)
                else:
                    lay.gu, lay.down = given["gu"], given["down"]
            elif sparse is not None:
                lay.moe = _experts(sparse, self.ops.silu_mul)
                sparse_owners.append((lay.moe, sparse))
            else:
                mlp = dec.mlp
                lay.gu = _TorchLinear(_cat([mlp.gate_proj.weight, mlp.up_proj.weight]), None)
                lay.down = _TorchLinear(mlp.down_proj.weight, None)
                owners[-1][1].update(gu=[mlp.gate_proj, mlp.up_proj], down=[mlp.down_proj])
            self.layers.append(lay)
        for moe, sp in sparse_owners if pack else ():
            _pack_experts(moe, sp, compact)
        for lay, parts in owners:  # the fused copies replace the modules' matrices
            for name, mods in parts.items():
                lin = getattr(lay, name)
                if pack:
                    setattr(lay, name, _packed(lin, mods, compact))
                elif name in ("proj", "gu"):  # a concatenated copy: the originals are not needed
                    for mod in mods:
                        mod.weight.data = mod.weight.data.new_empty(0)

    @classmethod
    def build(cls, model: Any, pack: bool = False, ops: Any = None, compact: bool = True,
              native_decode: bool = True, weights: Any = None) -> "HybridDecoder | None":
        """A fused decoder for a Qwen3.5 (dense or MoE) or Qwen3-Next ``model`` in float32, or None."""
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if getattr(cfg, "model_type", None) not in _TYPES or getattr(cfg, "hidden_act", None) != "silu":
            return None
        try:
            base = model.get_decoder()
            ok = base.norm.weight.dtype == torch.float32 or weights is not None
            for dec in base.layers:
                sparse = moe_parts(dec.mlp)
                ok = ok and ({n for n, _ in dec.mlp.named_children()} == _MLP_PARTS
                             or (sparse is not None and sparse.clamp is None and sparse.softmax_first))
                if hasattr(dec, "linear_attn"):
                    ok = ok and getattr(dec.linear_attn, "activation", "silu") == "silu"
            if not ok:
                return None
            return cls(model, cfg, pack, ops, compact, weights)
        except (AttributeError, TypeError, ValueError) as exc:
            log.info("fused decoder not used for %s: %s", type(model).__name__, exc)
            return None

    def linears(self) -> list[Linear]:
        out: list[Linear] = []
        for lay in self.layers:
            out += [lay.proj, lay.out, *((lay.gu, lay.down) if lay.moe is None else lay.moe.linears())]
        return out

    def tabulate_rope(self, max_len: int, dtype: torch.dtype) -> bool:
        return False  # decode steps stay eager (the recurrent layers gather their slots per step)

    def native_step(self, cache: PagedKVCache) -> Any:
        return None

    def _attend(self, lay: _HybridLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: PagedKVCache, meta: StepMetadata) -> torch.Tensor:
        T, H, kvh, D = x.shape[0], self.heads, self.kv_heads, self.head_dim
        y = lay.proj(x)
        q_end, k_end, v_end = H * D, (H + kvh) * D, (H + 2 * kvh) * D
        qk = y[:, :k_end].view(T, H + kvh, D)
        qk[:, :H] = F.rms_norm(qk[:, :H], (D,), lay.q_norm, lay.qk_eps)
        qk[:, H:] = F.rms_norm(qk[:, H:], (D,), lay.k_norm, lay.qk_eps)
        rot = cos.shape[-1]
        part = qk[..., :rot]
        half = rot // 2
        turned = torch.cat((part[..., half:].neg(), part[..., :half]), -1)
        part.mul_(cos[:, None]).addcmul_(turned, sin[:, None])
        v = y[:, k_end:v_end].view(T, kvh, D)
        layer = lay.idx if cache.layer_of is None else cache.layer_of[lay.idx]
        o = paged_attention(cache, meta, layer, qk[:, :H], qk[:, H:], v, lay.scaling)
        return lay.out(o.reshape(T, q_end) * torch.sigmoid(y[:, v_end:]))

    def _delta(self, lay: _HybridLayer, x: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        p = lay.delta
        y = lay.proj(x)
        c = 2 * p.key_heads * p.key_dim + p.value_heads * p.value_dim
        z_end = c + p.value_heads * p.value_dim
        mixed = mix(p, meta.states, y[:, :c], y[:, c:z_end], y[:, z_end:z_end + p.value_heads],
                    y[:, z_end + p.value_heads:])
        return lay.out(mixed)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                meta: StepMetadata, images: Any = None) -> torch.Tensor:
        """``input_ids``/``positions`` ``[T]`` -> final hidden states ``[T, hidden]``."""
        h = self.embed(input_ids)
        cos, sin = self.rotary(h, positions[None])
        cos, sin = cos[0].to(h.dtype), sin[0].to(h.dtype)
        ops = self.ops
        delta = None
        for lay in self.layers:
            x = ops.add_rms_norm(h, delta, lay.ln1, lay.eps)
            mixed = self._delta(lay, x, meta) if lay.delta is not None else self._attend(lay, x, cos, sin, cache, meta)
            x = ops.add_rms_norm(h, mixed, lay.ln2, lay.eps)
            delta = lay.moe(x) if lay.moe is not None else lay.down(ops.silu_mul(lay.gu(x)))
        return ops.add_rms_norm(h, delta, self.norm_w, self.norm_eps)
