"""The fused forward of the hybrid decoders: Qwen3.5 (dense and MoE) and Qwen3-Next (three Gated
DeltaNet layers to each gated full-attention layer) and LFM2 (short-convolution layers among
attention layers). Every layer's projections are fused into one product (and packed for the native
CPU kernels where they apply), the recurrent layers mix tokens over the step's state slots
(``recurrent.mix``, ``recurrent.short_conv``), the attention layers run on the paged KV cache.

A Qwen full-attention layer projects queries, keys, values and the output gate in one product (the
checkpoint interleaves each head's query and gate rows; they are reordered once, at build, to all
queries, keys, values, then all gates), normalises each query and key head, rotates the first
quarter of each head (partial RoPE), attends, and scales the result by ``sigmoid(gate)``; LFM2's
has no gate and rotates whole heads. A Gated DeltaNet layer projects the convolution's input, the
output gate and the two per-head scalars in one product (Qwen3-Next's checkpoint groups them by
key head: reordered once at build); a short-convolution layer projects ``B``, ``C`` and ``x`` in
one and returns ``C * conv(B * x)``. Qwen's norms scale by ``(1 + weight)`` (added once here
unless the weights come from a file that stores the sum), LFM2's by ``weight``. Qwen3.5-MoE's and
Qwen3-Next's layers end in ``moe.MoEFeedForward`` (routed experts and the shared one) where the
others end in one gated MLP.

``HybridDecoder.build`` returns None for anything else (a dtype other than float32); the runner
then keeps transformers' forward with the recurrent layers replaced (``recurrent.install``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .attention import PagedKVCache, StepMetadata, paged_attention
from .fused import Linear, TorchOps, _eps, _experts, _pack_experts, _packed, _TorchLinear, given_experts
from .moe import MoEFeedForward, SparseParts, moe_parts
from .recurrent import DeltaNetParams, ShortConvParams, mix, short_conv
from .vision import splice

log = logging.getLogger("llmserve.backend.torch")


@dataclass(frozen=True)
class _Family:
    """Where a family keeps its parts: the layer's two norms, the final norm, the MLP and its
    gate, up and down projections, the attention's head norms and output; whether norms scale by
    ``1 + weight`` and whether attention is gated."""

    ln1: str
    ln2: str
    final: str
    mlp: str
    mlp_parts: tuple[str, str, str]
    head_norms: tuple[str, str]
    attn_out: str
    offset: bool
    gated: bool


_QWEN = _Family("input_layernorm", "post_attention_layernorm", "norm", "mlp", ("gate_proj", "up_proj", "down_proj"),
                ("q_norm", "k_norm"), "o_proj", True, True)
_FAMILIES = {"qwen3_5_text": _QWEN, "qwen3_5_moe_text": _QWEN, "qwen3_next": _QWEN,
             "lfm2": _Family("operator_norm", "ffn_norm", "embedding_norm", "feed_forward", ("w1", "w3", "w2"),
                             ("q_layernorm", "k_layernorm"), "out_proj", False, False)}


class _HybridLayer:
    """One decoder layer: its norms and MLP (or experts), and its Gated DeltaNet (``delta``: the
    parameters ``recurrent.mix`` reads), its short convolution (``conv``) or its attention (both
    None)."""

    __slots__ = ("idx", "ln1", "ln2", "eps", "proj", "out", "gu", "down", "q_norm", "k_norm", "qk_eps",
                 "scaling", "delta", "conv", "moe")


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
    """Runs a hybrid decoder stack over one packed step (``FusedDecoder``'s interface)."""

    reduce = None  # tensor parallel refuses hybrid models
    rope_table = None

    def __init__(self, model: Any, cfg: Any, pack: bool = False, ops: Any = None, compact: bool = True,
                 weights: Any = None) -> None:
        base = model.get_decoder()
        fam = self.family = _FAMILIES[cfg.model_type]
        self.shift = fam.offset and not getattr(weights, "norms_shifted", False)
        self.embed = weights.embed if weights is not None else base.embed_tokens
        self.rotary = base.rotary_emb
        final = getattr(base, fam.final)
        self.norm_w, self.norm_eps = self._norm(final), _eps(final)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads)
        self.ops = ops if ops is not None else TorchOps()
        self.layers: list[_HybridLayer] = []
        # (layer, {its projection: the modules it was made from}), emptied or packed below
        owners: list[tuple[_HybridLayer, dict[str, list[Any]]]] = []
        sparse_owners: list[tuple[MoEFeedForward, SparseParts]] = []
        for i, dec in enumerate(base.layers):
            lay = _HybridLayer()
            lay.idx, lay.moe, lay.gu, lay.down, lay.delta, lay.conv = i, None, None, None, None, None
            lay.q_norm = lay.k_norm = None
            lay.qk_eps = lay.scaling = 0.0
            lay.ln1, lay.ln2 = self._norm(getattr(dec, fam.ln1)), self._norm(getattr(dec, fam.ln2))
            lay.eps = _eps(getattr(dec, fam.ln1))
            given = weights.layers[i] if weights is not None else None
            parts: dict[str, list[Any]] = {}
            if hasattr(dec, "linear_attn"):
                parts = self._delta_layer(lay, dec.linear_attn, given)
            elif hasattr(dec, "conv"):
                parts = self._conv_layer(lay, dec.conv, given)
            else:
                parts = self._attention_layer(lay, dec.self_attn, given)
            mlp = getattr(dec, fam.mlp)
            sparse = moe_parts(mlp)
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
                gate, up, down = (getattr(mlp, n) for n in fam.mlp_parts)
                lay.gu, lay.down = _TorchLinear(_cat([gate.weight, up.weight]), None), _TorchLinear(down.weight, None)
                parts.update(gu=[gate, up], down=[down])
            if parts:
                owners.append((lay, parts))
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

    def _norm(self, module: Any) -> torch.Tensor:
        w = module.weight.float()
        return (1.0 + w).contiguous() if self.shift else w.contiguous()

    def _delta_layer(self, lay: _HybridLayer, m: Any, given: dict[str, Any] | None) -> dict[str, list[Any]]:
        """A Gated DeltaNet layer's parameters and (from the model) its fused input projection."""
        lay.delta = DeltaNetParams.of(m) if given is None else given["delta"]
        if given is not None:
            return {}
        if hasattr(m, "in_proj_qkvz"):  # Qwen3-Next: rows grouped by key head
            parts = [m.in_proj_qkvz, m.in_proj_ba]
            lay.proj = _TorchLinear(_ungrouped(m), None)
        else:
            parts = [m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a]
            lay.proj = _TorchLinear(_cat([p.weight for p in parts]), None)
        lay.out = _TorchLinear(m.out_proj.weight, None)
        return {"proj": parts, "out": [m.out_proj]}

    def _conv_layer(self, lay: _HybridLayer, m: Any, given: dict[str, Any] | None) -> dict[str, list[Any]]:
        """A short-convolution layer's convolution and (from the model) its projections."""
        lay.conv = ShortConvParams.of(m) if given is None else given["conv"]
        if given is not None:
            return {}
        lay.proj = _TorchLinear(_cat([m.in_proj.weight]), m.in_proj.bias)
        lay.out = _TorchLinear(m.out_proj.weight, m.out_proj.bias)
        return {"proj": [m.in_proj], "out": [m.out_proj]}

    def _attention_layer(self, lay: _HybridLayer, attn: Any, given: dict[str, Any] | None) -> dict[str, list[Any]]:
        """An attention layer's head norms and (from the model) its fused projection: queries,
        keys, values (and, gated, each head's gate rows, moved after the values)."""
        q_norm, k_norm = (getattr(attn, n) for n in self.family.head_norms)
        lay.q_norm, lay.k_norm, lay.qk_eps = self._norm(q_norm), self._norm(k_norm), _eps(q_norm)
        lay.scaling = float(attn.scaling)
        if given is not None:
            return {}
        out = getattr(attn, self.family.attn_out)
        lay.out = _TorchLinear(out.weight, None)
        if self.family.gated:  # each head's query rows, then its gate rows: all queries first, all gates last
            H, D = self.heads, self.head_dim
            qg = attn.q_proj.weight.detach().view(H, 2, D, -1)
            lay.proj = _TorchLinear(_cat([qg[:, 0].reshape(H * D, -1), attn.k_proj.weight, attn.v_proj.weight,
                                          qg[:, 1].reshape(H * D, -1)]), None)
        else:
            lay.proj = _TorchLinear(_cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), None)
        return {"proj": [attn.q_proj, attn.k_proj, attn.v_proj], "out": [out]}

    @classmethod
    def build(cls, model: Any, pack: bool = False, ops: Any = None, compact: bool = True,
              native_decode: bool = True, weights: Any = None) -> "HybridDecoder | None":
        """A fused decoder for a Qwen3.5 (dense or MoE), Qwen3-Next or LFM2 ``model`` in float32,
        or None."""
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        fam = _FAMILIES.get(getattr(cfg, "model_type", None))
        if fam is None or getattr(cfg, "hidden_act", "silu") != "silu":  # LFM2's MLP is always SiLU-gated
            return None
        try:
            base = model.get_decoder()
            ok = getattr(base, fam.final).weight.dtype == torch.float32 or weights is not None
            for dec in base.layers:
                mlp = getattr(dec, fam.mlp)
                sparse = moe_parts(mlp)
                ok = ok and ({n for n, _ in mlp.named_children()} <= {*fam.mlp_parts, "act_fn"}
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
        o = paged_attention(cache, meta, layer, qk[:, :H], qk[:, H:], v, lay.scaling).reshape(T, q_end)
        return lay.out(o * torch.sigmoid(y[:, v_end:]) if self.family.gated else o)

    def _short_conv(self, lay: _HybridLayer, x: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        y = lay.proj(x)
        n = y.shape[1] // 3
        return lay.out(y[:, n:2 * n] * short_conv(lay.conv, meta.states, y[:, :n] * y[:, 2 * n:]))

    def _delta(self, lay: _HybridLayer, x: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        p = lay.delta
        y = lay.proj(x)
        c = 2 * p.key_heads * p.key_dim + p.value_heads * p.value_dim
        z_end = c + p.value_heads * p.value_dim
        mixed = mix(p, meta.states, y[:, :c], y[:, c:z_end], y[:, z_end:z_end + p.value_heads],
                    y[:, z_end + p.value_heads:])
        return lay.out(mixed)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                meta: StepMetadata, images: Any = None, rope: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids``/``positions`` ``[T]`` -> final hidden states ``[T, hidden]``. ``images``: a
        vision model's image features (``vision.splice``); ``rope``: ``[3, T]`` positions by axis
        for its multimodal RoPE, which the model's rotary module takes as they are (mrope.py)."""
        h = self.embed(input_ids)
        splice(h, images)
        cos, sin = self.rotary(h, positions[None] if rope is None else rope[:, None])
        cos, sin = cos[0].to(h.dtype), sin[0].to(h.dtype)
        ops = self.ops
        delta = None
        for lay in self.layers:
            x = ops.add_rms_norm(h, delta, lay.ln1, lay.eps)
            mixed = (self._delta(lay, x, meta) if lay.delta is not None else self._short_conv(lay, x, meta)
                     if lay.conv is not None else self._attend(lay, x, cos, sin, cache, meta))
            x = ops.add_rms_norm(h, mixed, lay.ln2, lay.eps)
            delta = lay.moe(x) if lay.moe is not None else lay.down(ops.silu_mul(lay.gu(x)))
        return ops.add_rms_norm(h, delta, self.norm_w, self.norm_eps)
