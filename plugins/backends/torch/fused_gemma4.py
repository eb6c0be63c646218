"""The fused forward of Gemma 4's text decoder (``gemma4_text``): fused projections over the paged
KV cache, as ``fused.FusedDecoder`` runs Llama-style stacks, with what Gemma 4 adds:

- global layers with fewer, wider heads than the sliding ones (each a pool layer of its own shape,
  ``kv_layout.py``), whose keys may double as their values (``attention_k_eq_v``);
- RMSNorm of every query, key and value head (values without a scale), attention scaled by 1;
- the last ``num_kv_shared_layers`` layers project queries only and attend over the keys and
  values of the last earlier layer of their kind (this step's rows come from that layer, the
  cached ones from its pool layer, which they never write);
- per-layer embeddings: a table lookup per token and a projection of its embedding, one slice of
  each added through a gate after every layer's feed-forward, then a scalar per layer;
- the 26B-A4B's mixture of experts beside the dense MLP, each with norms of its own, the router
  over a scaled RMSNorm of the residual stream with a learned scale per expert;
- RoPE per layer kind, the global layers' "proportional" kind rotating a quarter of each head
  (its table's other angles are zero: cos 1, sin 0).

``Gemma4Decoder.build`` returns None for anything it does not recognise exactly (transformers'
forward then runs with the paged attention plugged in).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .attention import PagedKVCache, StepMetadata, paged_attention
from .fused import _STATIC_ROPE, TorchOps, _eps, _fuse, _is_rms_norm, _packed, _TorchLinear
from .moe import MoEFeedForward

log = logging.getLogger("llmserve.backend.torch")

_STATIC = _STATIC_ROPE | {"proportional"}
_LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm"}
_PLE_PARTS = {"act_fn", "per_layer_input_gate", "per_layer_projection", "post_per_layer_input_norm"}
_MOE_PARTS = {"router", "experts", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
              "pre_feedforward_layernorm_2"}
_OWN_KV = {"q_proj", "k_proj", "o_proj", "q_norm", "k_norm", "v_norm"}  # (+ v_proj unless keys are values)
_MLP = {"gate_proj", "up_proj", "down_proj", "act_fn"}


class _Layer:
    __slots__ = ("idx", "kind", "kv_heads", "head_dim", "shared", "store", "keys_are_values", "qkv", "o", "gu",
                 "down", "ln1", "post_attn", "ln2", "post_mlp", "q_norm", "k_norm", "window", "ple_gate",
                 "ple_proj", "ple_norm", "scalar", "moe", "moe_router", "moe_pre", "moe_post", "mlp_post")


class _Router:
    """Gemma 4's router logits: its projection of an unscaled RMSNorm of the residual stream times
    a learned scale and ``hidden ** -0.5`` (transformers' order of operations)."""

    def __init__(self, router: Any, proj: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.proj: Callable[[torch.Tensor], torch.Tensor] = proj or _TorchLinear(router.proj.weight, None)
        self.scale, self.root, self.eps = router.scale.detach(), float(router.scalar_root_size), float(router.eps)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.proj(normed.mul_(self.scale).mul_(self.root))


class _PerLayerInputs:
    """The per-layer embeddings' two parts (transformers' ``get_per_layer_inputs`` and
    ``project_per_layer_inputs``): each token's row of a table of every layer's slices, scaled by
    the square root of a slice's width, and a projection of its embedding, normed per slice;
    their sum times ``2 ** -0.5``."""

    def __init__(self, base: Any, width: int, given: dict[str, Any] | None = None) -> None:
        table = base.embed_tokens_per_layer
        self.width = width
        # Token ids -> float32 rows of the table: the model's own tensor, or a GGUF file's rows in place.
        if given:
            from .gguf_gemma4 import ple_lookup

            self.lookup = ple_lookup(given["ple_table"])
        else:
            weight = table.weight.detach()
            self.lookup = lambda ids: F.embedding(ids, weight)
        # The scale as a float32 number: a bf16 checkpoint's buffer holds it rounded to bf16, which
        # its float32 forward does not (transformers' float32 load computes it in float32).
        self.factor = float(table.scalar_embed_scale)
        self.proj: Callable[[torch.Tensor], torch.Tensor] = (given["ple_proj"] if given else _TorchLinear(
            base.per_layer_model_projection.weight, None))
        self.proj_scale = float(base.per_layer_model_projection_scale)
        self.norm_w = base.per_layer_projection_norm.weight
        self.join = float(base.per_layer_input_scale)

    def take(self, module: Any) -> None:
        """Hold the table as stored (a bf16 checkpoint's stays bf16, looked up as float32 rows)."""
        module.weight.data = module.weight.data.new_empty(0)

    def __call__(self, input_ids: torch.Tensor, h: torch.Tensor, layers: int, ops: Any, eps: float) -> torch.Tensor:
        """``[T, layers, width]`` for the tokens ``input_ids`` whose scaled embeddings are ``h``."""
        T, width = h.shape[0], self.width
        factor = torch.tensor(self.factor, dtype=torch.float32).to(h.dtype)
        tokens = self.lookup(input_ids).to(h.dtype).mul_(factor).view(T, layers, width)
        mixed = self.proj(h).mul_(self.proj_scale).reshape(T * layers, width)
        mixed = ops.add_rms_norm(mixed, None, self.norm_w, eps).view(T, layers, width)
        return mixed.add_(tokens).mul_(self.join)


class Gemma4Decoder:
    """Runs Gemma 4's text decoder stack over one packed step."""

    def __init__(self, model: Any, cfg: Any, pack: bool = False, ops: Any = None, compact: bool = True,
                 weights: Any = None) -> None:
        base = model.get_decoder()
        self.embed = base.embed_tokens  # (its module multiplies by sqrt(hidden))
        if weights is not None:  # a GGUF file's rows, times the scale as the module multiplies (float32)
            factor = torch.tensor(float(base.embed_tokens.scalar_embed_scale), dtype=torch.float32)
            self.embed = lambda ids: weights.embed(ids).mul_(factor)
        self.rotary = base.rotary_emb
        self.norm_w, self.norm_eps = base.norm.weight, _eps(base.norm)
        self.eps = float(cfg.rms_norm_eps)
        self.heads = int(cfg.num_attention_heads)
        self.ops = ops if ops is not None else TorchOps()
        self.reduce: Callable[[torch.Tensor], None] | None = None  # (no tensor parallel: kv_layout shapes)
        self.rope_table: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
        # Per-layer embeddings: the token table (its module scales by sqrt(width)), the projection of
        # the token's embedding and its norm; None when the model has none.
        self.ple: _PerLayerInputs | None = None
        if getattr(cfg, "hidden_size_per_layer_input", 0):
            self.ple = _PerLayerInputs(base, int(cfg.hidden_size_per_layer_input),
                                       weights.model_parts if weights is not None else None)
        modes = list(cfg.kv_sharing_modes)
        self.layers: list[_Layer] = []
        owners: list[tuple[_Layer, dict[str, list[torch.nn.Linear]]]] = []
        for i, dec in enumerate(base.layers):
            attn, mlp = dec.self_attn, dec.mlp
            lay = _Layer()
            lay.idx, lay.kind = i, str(attn.layer_type)
            lay.shared, lay.store = modes[i] == "reuse", modes[i] == "store"
            lay.head_dim = int(attn.head_dim)
            lay.kv_heads = 0 if lay.shared else attn.k_proj.weight.shape[0] // lay.head_dim
            lay.keys_are_values = not lay.shared and attn.v_proj is None
            given = weights.layers[i] if weights is not None else None
            if given is not None:  # a GGUF file's products
                lay.qkv, lay.o, lay.gu, lay.down = given["qkv"], given["o"], given["gu"], given["down"]
            else:
                qkv = [attn.q_proj] + ([] if lay.shared else [attn.k_proj] + ([] if lay.keys_are_values else
                                                                               [attn.v_proj]))
                lay.qkv, lay.o = _TorchLinear(*_fuse(qkv)), _TorchLinear(attn.o_proj.weight, None)
                gu = [mlp.gate_proj, mlp.up_proj]
                lay.gu, lay.down = _TorchLinear(*_fuse(gu)), _TorchLinear(mlp.down_proj.weight, None)
                owners.append((lay, {"qkv": qkv, "o": [attn.o_proj], "gu": gu, "down": [mlp.down_proj]}))
            lay.ln1, lay.post_attn = dec.input_layernorm.weight, dec.post_attention_layernorm.weight
            lay.ln2, lay.post_mlp = dec.pre_feedforward_layernorm.weight, dec.post_feedforward_layernorm.weight
            lay.q_norm = attn.q_norm.weight
            lay.k_norm = attn.q_norm.weight if lay.shared else attn.k_norm.weight
            lay.window = attn.sliding_window
            lay.ple_gate = lay.ple_proj = lay.ple_norm = None
            if self.ple is not None:
                lay.ple_gate = given["ple_gate"] if given else _TorchLinear(dec.per_layer_input_gate.weight, None)
                lay.ple_proj = given["ple_proj"] if given else _TorchLinear(dec.per_layer_projection.weight, None)
                lay.ple_norm = dec.post_per_layer_input_norm.weight
            lay.scalar = dec.layer_scalar.detach()
            lay.moe = lay.moe_router = lay.moe_pre = lay.moe_post = lay.mlp_post = None
            if getattr(dec, "enable_moe_block", False):
                ex = dec.experts
                count = ex.gate_up_proj.shape[0]
                moe = given["experts"] if given else None
                lay.moe_router = _Router(dec.router, moe["router"] if moe else None)
                gate_up = moe["gate_up"] if moe else [_TorchLinear(ex.gate_up_proj[e], None) for e in range(count)]
                down = moe["down"] if moe else [_TorchLinear(ex.down_proj[e], None) for e in range(count)]
                lay.moe = MoEFeedForward(lay.moe_router, gate_up, down, int(cfg.top_k_experts), True,
                                         self.ops.gelu_tanh_mul,
                                         expert_scale=dec.router.per_expert_scale.detach().float())
                lay.moe_pre = dec.pre_feedforward_layernorm_2.weight
                lay.moe_post = dec.post_feedforward_layernorm_2.weight
                lay.mlp_post = dec.post_feedforward_layernorm_1.weight
            self.layers.append(lay)
        self.rope_kinds = list(dict.fromkeys(lay.kind for lay in self.layers))
        # The first of the last layers that all read earlier layers' keys (none: past the end).
        writers = [lay.idx for lay in self.layers if not lay.shared]
        self.first_reader = (writers[-1] + 1) if writers else 0
        if pack:
            self._pack(base, owners, compact)

    def _pack(self, base: Any, owners: list[tuple[_Layer, dict[str, list[torch.nn.Linear]]]], compact: bool) -> None:
        """Every product in the native kernel's layout where it applies (a bf16 checkpoint's as bf16
        rows), the model's own weights emptied so nothing is held twice; the per-layer token
        table kept as stored (bf16 rows are looked up as float32)."""
        from .native.ops import packed_linear

        for lay, parts in owners:
            for name, mods in parts.items():
                setattr(lay, name, _packed(getattr(lay, name), mods, compact))
        for lay, dec in zip(self.layers, base.layers):
            if lay.ple_gate is not None:
                lay.ple_gate = _packed(lay.ple_gate, [dec.per_layer_input_gate], compact)
                lay.ple_proj = _packed(lay.ple_proj, [dec.per_layer_projection], compact)
            if lay.moe is not None:
                ex, moe = dec.experts, lay.moe
                groups = [[packed_linear(lin.weight.contiguous(), None, compact) for lin in group]
                          for group in (moe.gate_up, moe.down)]
                if all(p is not None for group in groups for p in group):
                    moe.gate_up, moe.down = groups[0], groups[1]
                    for t in (ex.gate_up_proj, ex.down_proj):
                        t.data = t.data.new_empty(0)
                lay.moe_router.proj = _packed(lay.moe_router.proj, [dec.router.proj], compact)
        if self.ple is not None:
            self.ple.proj = _packed(self.ple.proj, [base.per_layer_model_projection], compact)
            self.ple.take(base.embed_tokens_per_layer)

    @classmethod
    def build(cls, model: Any, pack: bool = False, ops: Any = None, compact: bool = True,
              native_decode: bool = True, weights: Any = None) -> "Gemma4Decoder | None":
        """The fused forward for a Gemma 4 text model, or None when its layers are not exactly the
        ones this forward knows (see ``FusedDecoder.build`` for the arguments; there is no
        one-call native decode step)."""
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if getattr(cfg, "model_type", None) != "gemma4_text" or cfg.hidden_activation != "gelu_pytorch_tanh":
            return None
        try:
            base = model.get_decoder()
            ok = base.norm.weight.dtype == torch.float32 and not getattr(cfg, "use_bidirectional_attention", None)
            ok = ok and not getattr(cfg, "attention_bias", False)
            kinds = getattr(base.rotary_emb, "rope_type", {})
            ok = ok and isinstance(kinds, dict) and set(kinds.values()) <= _STATIC
            for dec in base.layers:
                parts = {n for n, _ in dec.named_children()}
                moe = getattr(dec, "enable_moe_block", False)
                want = _LAYER_PARTS | (_PLE_PARTS if cfg.hidden_size_per_layer_input else set()) | (
                    _MOE_PARTS if moe else set())
                attn = dec.self_attn
                own = {n for n, _ in attn.named_children()}
                want_attn = ({"q_proj", "o_proj", "q_norm"} if attn.is_kv_shared_layer
                             else _OWN_KV | ({"v_proj"} if attn.v_proj is not None else set()))
                ok = ok and parts == want and own == want_attn and {n for n, _ in dec.mlp.named_children()} == _MLP
                ok = ok and all(_is_rms_norm(m) for n, m in dec.named_children() if "norm" in n)
                ok = ok and tuple(dec.layer_scalar.shape) == (1,)
            if not ok:
                return None
            return cls(model, cfg, pack, ops, compact, weights)
        except (AttributeError, TypeError, ValueError) as exc:
            log.info("fused decoder not used for %s: %s", type(model).__name__, exc)
            return None

    def linears(self) -> list[Any]:
        out: list[Any] = [self.ple.proj] if self.ple is not None else []
        for lay in self.layers:
            out += [lay.qkv, lay.o, lay.gu, lay.down, lay.ple_gate, lay.ple_proj]
            if lay.moe is not None:
                out += lay.moe.linears()
        return [lin for lin in out if lin is not None]

    def native_step(self, cache: PagedKVCache) -> None:
        """No one-call native decode step: its layers differ in shape (the Python layer loop runs)."""
        return None

    def _rotary(self, probe: torch.Tensor, positions: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary(probe, positions[None], kind)
        return cos[0].contiguous(), sin[0].contiguous()

    def tabulate_rope(self, max_len: int, dtype: torch.dtype) -> bool:
        """cos/sin of positions ``0 .. max_len - 1`` per layer kind, computed once (every Gemma 4
        RoPE kind depends on the position alone)."""
        device = self.norm_w.device
        probe, positions = torch.empty(1, dtype=dtype, device=device), torch.arange(max_len, device=device)
        self.rope_table = {kind: self._rotary(probe, positions, kind) for kind in self.rope_kinds}
        return True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                meta: StepMetadata, images: tuple[torch.Tensor, torch.Tensor] | None = None,
                rope: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids``/``positions`` ``[T]`` -> final hidden states ``[T, hidden]``; writes the KV."""
        if images is not None or rope is not None:
            raise ValueError("Gemma 4's fused forward reads text only")
        T, H, ops, eps = input_ids.shape[0], self.heads, self.ops, self.eps
        h = self.embed(input_ids)
        ple = self.ple(input_ids, h, len(self.layers), ops, eps) if self.ple is not None else None
        table = self.rope_table
        ropes = {kind: (table[kind][0][positions], table[kind][1][positions]) if table is not None
                 else self._rotary(h, positions, kind) for kind in self.rope_kinds}
        current: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # kind -> this step's keys and values to share
        whole, rows = h, None
        for lay in self.layers:
            if lay.idx == self.first_reader and meta.read_rows is not None and (picked := meta.read_rows()):
                # From here on no layer writes keys: only the rows the step reads are computed
                # (a prompt chunk's last row, not all of it), each attending as a decode row.
                rows, meta = picked
                T, h = rows.numel(), h.index_select(0, rows)
                ple = ple.index_select(0, rows) if ple is not None else None
                ropes = {kind: (c.index_select(0, rows), s.index_select(0, rows)) for kind, (c, s) in ropes.items()}
                current = {kind: (k.index_select(0, rows), v.index_select(0, rows)) for kind, (k, v) in current.items()}
            D, kvh = lay.head_dim, lay.kv_heads
            cos, sin = ropes[lay.kind]
            x = ops.add_rms_norm(h, None, lay.ln1, eps)
            qkv = lay.qkv(x)
            if lay.shared:
                k, v = current[lay.kind]
            else:  # values: the projection's (or the keys' before their norm), RMSNorm'd without a scale
                raw = qkv[:, (H + kvh) * D:] if not lay.keys_are_values else qkv[:, H * D:(H + kvh) * D]
                v = F.rms_norm(raw.reshape(T, kvh, D), (D,), eps=eps)
                k = qkv[:, H * D:(H + kvh) * D].view(T, kvh, D)
            ops.qk_norm(qkv, H, kvh, D, lay.q_norm, lay.k_norm, eps)
            ops.rope(qkv, H + kvh, D, cos, sin)
            if lay.store:
                current[lay.kind] = (k, v)
            layer = lay.idx if cache.layer_of is None else cache.layer_of[lay.idx]
            o = paged_attention(cache, meta, layer, qkv[:, :H * D].view(T, H, D), k, v, 1.0, lay.window,
                                kv_written=lay.shared)
            attn = ops.add_rms_norm(lay.o(o.reshape(T, H * D)), None, lay.post_attn, eps)
            x = ops.add_rms_norm(h, attn, lay.ln2, eps)                        # h += attention
            y = lay.down(ops.gelu_tanh_mul(lay.gu(x)))
            if lay.moe is not None:  # the experts beside the dense MLP, each normed, then summed
                y = ops.add_rms_norm(y, None, lay.mlp_post, eps)
                z = lay.moe(ops.add_rms_norm(h, None, lay.moe_pre, eps), route=h)
                y = y.add_(ops.add_rms_norm(z, None, lay.moe_post, eps))
            h.add_(ops.add_rms_norm(y, None, lay.post_mlp, eps))
            if ple is not None:
                g = ops.gelu_tanh_mul(torch.cat((lay.ple_gate(h), ple[:, lay.idx]), -1))
                h.add_(ops.add_rms_norm(lay.ple_proj(g), None, lay.ple_norm, eps))
            h.mul_(lay.scalar)
        if rows is not None:  # (the other rows keep what the last writing layer left: nobody reads them)
            h = whole.index_copy_(0, rows, h)
        return ops.add_rms_norm(h, None, self.norm_w, self.norm_eps)
