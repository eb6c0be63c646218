"""A hand-written forward for Llama-style decoders (Llama, Mistral, Qwen2, Qwen3, SmolLM...) with fused
projections: one matmul for Q, K and V and one for the MLP's gate and up, fewer small ops per
layer than transformers' modules. It reuses the loaded model's own weights (the fused matrices
are built once and the original parameters become views of them, so memory does not grow) and
its rotary embedding (every RoPE scaling variant it knows).

With ``pack=True`` (fp32 on a CPU where the native kernel builds) each projection is copied into
the packed layout of ``native.ops.PackedLinear`` and the unpacked copy is released: the layers
of the transformers model are then left without weights (empty tensors, so calling them fails
loudly instead of computing garbage) and only this forward can run them.

``FusedDecoder.build(model)`` returns None for anything it does not recognise exactly; the
runner then keeps transformers' forward with the paged attention plugged in.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
import torch.nn.functional as F

from . import mrope, vision
from .attention import PagedKVCache, StepMetadata, paged_attention
from .moe import MoEFeedForward, SharedExpert, SparseParts, clamped_swiglu, moe_parts

log = logging.getLogger("llmserve.backend.torch")



@dataclass(frozen=True)
class _Family:
    """How a model type's decoder layers differ from Llama's."""

    act: str = "silu"            # the MLP gate's activation (transformers' name)
    norm_offset: bool = False    # RMSNorm scales by (1 + weight), computed in fp32 (Gemma)
    sandwich: bool = False       # norms on the attention's and the MLP's outputs too, before each residual add


_FAMILIES = {"llama": _Family(), "mistral": _Family(), "qwen2": _Family(), "qwen3": _Family(),
             "qwen3_moe": _Family(), "mixtral": _Family(), "phi3": _Family(), "gpt_oss": _Family(),
             "gemma3_text": _Family(act="gelu_pytorch_tanh", norm_offset=True, sandwich=True)}
# Families that take their sliding window from the config for every layer (their attention modules keep none).
_CONFIG_WINDOW = {"mistral", "mixtral", "phi3"}
_ARCHITECTURES = set(_FAMILIES)
_FAMILIES.update({"qwen2_vl_text": _FAMILIES["qwen2"], "qwen2_5_vl_text": _FAMILIES["qwen2"],  # (vision models')
                  "qwen3_vl_text": _FAMILIES["qwen3"]})
# RoPE types whose angles depend on the position alone: a table of every position gives the same
# bits as computing them per step ("dynamic" and "longrope" rescale with the sequence length).
_STATIC_ROPE = {"default", "linear", "llama3", "yarn"}
_LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_SANDWICH_PARTS = _LAYER_PARTS | {"pre_feedforward_layernorm", "post_feedforward_layernorm"}
_DROPOUT_PARTS = _LAYER_PARTS | {"resid_attn_dropout", "resid_mlp_dropout"}  # Phi-3: identities when serving
_ATTN_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj", "rotary_fn", "q_norm", "k_norm"}
_FUSED_ATTN_PARTS = {"qkv_proj", "o_proj", "rotary_fn"}  # Phi-3 stores Q, K and V as one matrix
_MLP_PARTS = {"gate_proj", "up_proj", "down_proj", "act_fn"}
_FUSED_MLP_PARTS = {"gate_up_proj", "down_proj", "activation_fn"}  # Phi-3: gate and up as one matrix


def _fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of ``linears`` along the output dim; re-point each
    module's parameters at its slice of the result so nothing is stored twice. One linear (a
    matrix the model already stores fused, as Phi-3's) is used as it is, not copied."""
    if len(linears) == 1:
        only = linears[0]
        return only.weight.data, only.bias.data if only.bias is not None else None
    weight = torch.cat([m.weight.data for m in linears])
    has_bias = [m.bias is not None for m in linears]
    if any(has_bias) and not all(has_bias):
        raise ValueError("mixed biases")
    bias = torch.cat([m.bias.data for m in linears]) if all(has_bias) else None
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = weight[row:row + n]
        if bias is not None:
            m.bias.data = bias[row:row + n]
        row += n
    return weight, bias


# Up to this many rows a bf16 projection on the CPU runs as ``W @ x^T`` (one row: a matrix-vector
# product): oneDNN's bf16 ``F.linear`` takes 1.3-1.7x as long on decode-sized inputs (a [16384, 2048]
# weight: 4.8 ms against 3.6 ms for one row and 7.1 against 5.2 ms for 32, one thread), and more
# with two threads; from about 128 rows (prefill chunks) ``F.linear`` is the faster one.
_LEFT_ROWS = 64


class _TorchLinear:
    """``F.linear`` with its weight and bias bound: the unpacked counterpart of PackedLinear."""

    __slots__ = ("weight", "bias", "left")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        self.left = weight.device.type == "cpu" and weight.dtype == torch.bfloat16

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.left and x.dim() == 2 and x.shape[0] <= _LEFT_ROWS:
            w = self.weight
            y = torch.mv(w, x[0]).unsqueeze(0) if x.shape[0] == 1 else torch.mm(w, x.t()).t().contiguous()
            return y if self.bias is None else y.add_(self.bias)
        return F.linear(x, self.weight, self.bias)


Linear = Callable[[torch.Tensor], torch.Tensor]


def _packed(unpacked: _TorchLinear, owners: list[torch.nn.Linear], compact: bool) -> Linear:
    """The projection packed for the native CPU kernel (``compact``: lossless 4- or 8-bit panels
    where they apply), the ``owners``' parameters emptied so the unpacked weight is freed;
    ``unpacked`` itself where the kernel does not apply."""
    from .native.ops import packed_linear

    packed = packed_linear(unpacked.weight, unpacked.bias, compact)
    if packed is None:
        return unpacked
    for m in owners:
        m.weight.data = m.weight.data.new_empty(0)
        if m.bias is not None:
            m.bias.data = m.bias.data.new_empty(0)
    return packed


class TorchOps:
    """The forward's small per-layer operations in plain torch (any device and dtype); the
    native ``native.ops.ElementwiseOps`` has the same methods for CPU fp32."""

    @staticmethod
    def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``h += delta`` in place (when given), then RMSNorm of ``h`` scaled by ``weight``."""
        if delta is not None:
            h.add_(delta)
        if h.dtype == torch.float32:
            return F.rms_norm(h, weight.shape, weight, eps)
        # transformers' order of operations: normalise in fp32, cast back, then scale.
        x = h.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x.to(h.dtype)

    @staticmethod
    def silu_mul(gu: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of a ``[T, 2 * I]`` gate-and-up tensor -> ``[T, I]``."""
        inter = gu.shape[-1] // 2
        return F.silu(gu[:, :inter]).mul_(gu[:, inter:])

    @staticmethod
    def gelu_tanh_mul(gu: torch.Tensor) -> torch.Tensor:
        """``gelu_tanh(gate) * up`` (GELU's tanh approximation, Gemma's MLP) -> ``[T, I]``."""
        inter = gu.shape[-1] // 2
        return F.gelu(gu[:, :inter], approximate="tanh").mul_(gu[:, inter:])

    @staticmethod
    def qk_norm(x: torch.Tensor, heads: int, kv_heads: int, head_dim: int, q_weight: torch.Tensor,
                k_weight: torch.Tensor, eps: float) -> None:
        """RMSNorm in place of each query head (the first ``heads`` of each row of ``x``, scaled by
        ``q_weight``) and each key head (the ``kv_heads`` after them, by ``k_weight``)."""
        T = x.shape[0]
        for first, count, weight in ((0, heads, q_weight), (heads, kv_heads, k_weight)):
            part = x[:, first * head_dim:(first + count) * head_dim].view(T, count, head_dim)
            if part.dtype == torch.float32:
                part.copy_(F.rms_norm(part, weight.shape, weight, eps))
            else:  # transformers' order: normalise in fp32, cast back, then scale
                y = part.float()
                part.copy_(weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(part.dtype))

    @staticmethod
    def rope(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotary embedding ("rotate half") in place on the first ``heads`` heads of each row of
        ``x``, with per-row ``cos``/``sin`` ``[T, head_dim]``."""
        qk = x[:, :heads * head_dim].view(x.shape[0], heads, head_dim)
        half = head_dim // 2
        rot = torch.cat((qk[..., half:].neg(), qk[..., :half]), -1)
        qk.mul_(cos[:, None]).addcmul_(rot, sin[:, None])


class _Layer:
    __slots__ = ("idx", "ln1", "ln2", "eps1", "eps2", "qkv", "o", "gu", "down", "scaling", "window", "q_norm",
                 "k_norm", "qk_eps", "post_attn", "post_mlp", "post_eps", "act", "gelu", "rope", "moe", "sinks")


def _moe_act(sp: SparseParts, act: Callable[[torch.Tensor], torch.Tensor],
             interleaved: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """The experts' gated activation: the family's, or gpt-oss's clamped SwiGLU (``interleaved``:
    gate and up alternate, as the checkpoint stores them; a GGUF file stores them as halves)."""
    if sp.clamp is None:
        return act
    return partial(clamped_swiglu, alpha=sp.clamp[0], limit=sp.clamp[1], interleaved=interleaved)


def _experts(sp: SparseParts, act: Callable[[torch.Tensor], torch.Tensor]) -> MoEFeedForward:
    """The MoE feed-forward over a transformers block's router and 3-D expert tensors (views of
    each expert's slice)."""
    count = sp.experts.gate_up_proj.shape[0]
    gu = [_TorchLinear(sp.gate_up_weight(e), sp.bias("gate_up_proj", e)) for e in range(count)]
    down = [_TorchLinear(sp.down_weight(e), sp.bias("down_proj", e)) for e in range(count)]
    router = _TorchLinear(sp.router.weight, sp.router.bias if sp.biases else None)
    shared = None
    if sp.shared is not None:  # gate and up fused (the modules' weights become views), as a dense MLP's
        m = sp.shared
        shared = SharedExpert(_TorchLinear(*_fuse([m.gate_proj, m.up_proj])), _TorchLinear(m.down_proj.weight, None),
                              _TorchLinear(sp.shared_gate.weight, None), act)
    return MoEFeedForward(router, gu, down, sp.top_k, sp.normalize, _moe_act(sp, act, True), sp.softmax_first,
                          shared)


def given_experts(given: dict[str, Any], sp: SparseParts,
                  act: Callable[[torch.Tensor], torch.Tensor]) -> MoEFeedForward:
    """The MoE feed-forward over a GGUF file's products (``gguf_model._Mapper.experts``)."""
    shared = given.get("shared")
    return MoEFeedForward(given["router"], given["gate_up"], given["down"], sp.top_k, sp.normalize,
                          _moe_act(sp, act, False), sp.softmax_first,
                          SharedExpert(*shared, act) if shared is not None else None)


def _pack_experts(moe: MoEFeedForward, sp: SparseParts, compact: bool) -> None:
    """``moe``'s experts and router copied into the native kernel's layout where it applies;
    the model's 3-D tensors are then emptied so the experts are not held twice."""
    from .native.ops import packed_linear

    experts = sp.experts
    if moe.shared is not None:
        shared, m = moe.shared, sp.shared
        shared.gate_up = _packed(shared.gate_up, [m.gate_proj, m.up_proj], compact)
        shared.down = _packed(shared.down, [m.down_proj], compact)

    groups = [[packed_linear(lin.weight.contiguous(), lin.bias, compact) for lin in group]
              for group in (moe.gate_up, moe.down)]
    if all(p is not None for group in groups for p in group):
        moe.gate_up, moe.down = groups[0], groups[1]
        for t in (experts.gate_up_proj, experts.down_proj):
            t.data = t.data.new_empty(0)
    moe.router = packed_linear(moe.router.weight, moe.router.bias, compact) or moe.router


def _eps(norm: Any) -> float:
    """An RMSNorm module's epsilon (Llama's modules call it ``variance_epsilon``, Gemma's ``eps``)."""
    return float(norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps)


def _is_rms_norm(norm: Any) -> bool:
    return type(norm).__name__.endswith("RMSNorm") and (hasattr(norm, "variance_epsilon") or hasattr(norm, "eps"))


class FusedDecoder:
    """Runs the decoder stack of a Llama-style model over one packed step."""

    def __init__(self, model: Any, cfg: Any, pack: bool = False, ops: Any = None, compact: bool = True,
                 native_decode: bool = True, weights: Any = None) -> None:
        base = model.get_decoder()
        family = _FAMILIES[cfg.model_type]
        # Gemma's norms scale by (1 + weight): added once here, in fp32 as its forward does, unless
        # the weights come from a file that stores them so (llama.cpp's converter adds the 1).
        shift = family.norm_offset and not getattr(weights, "norms_shifted", False)

        def norm_weight(norm: Any) -> torch.Tensor:
            return (1.0 + norm.weight.float()).contiguous() if shift else norm.weight

        # ``weights``: ready-made projections and embedding (``gguf_model.GGUFParts``) for a model
        # whose transformers modules hold no matrices (built on the meta device).
        self.embed = weights.embed if weights is not None else base.embed_tokens
        scale = getattr(base.embed_tokens, "scalar_embed_scale", None)  # Gemma: embeddings times sqrt(hidden)
        if weights is not None and scale is not None:
            # transformers' module multiplies by a float32 tensor of the scale: the same rounding.
            factor = torch.tensor(float(scale), dtype=torch.float32)
            self.embed = lambda ids: weights.embed(ids).mul_(factor)
        self.rotary = base.rotary_emb
        self.norm_w, self.norm_eps = norm_weight(base.norm), _eps(base.norm)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads)
        # Each rotary dimension's axis for a multimodal RoPE (mrope.py); else None.
        self.mrope_axes = mrope.frequency_axes(model, self.rotary, self.head_dim, self.norm_w.device)
        self.layers: list[_Layer] = []
        # Gemma 3 rotates local (sliding-window) and global layers with RoPE of their own bases:
        # its rotary module takes the layer type. None: one RoPE for every layer.
        self.rope_kinds: list[str | None] = [None]
        # cos/sin of every position per RoPE kind (``tabulate_rope``): a lookup, which a CUDA graph can hold
        self.rope_table: dict[str | None, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.ops = ops if ops is not None else TorchOps()  # norms, activations and RoPE
        # Decode-only steps as one native call when every part is native (native/step.py);
        # False keeps the Python layer loop for every step.
        self.native_decode = native_decode
        # Tensor parallel: sums the row-parallel outputs (o, down) of every rank in place; the
        # one-call native step cannot pause for it, so a set ``reduce`` keeps the layer loop.
        self.reduce: Callable[[torch.Tensor], None] | None = None
        self._native: tuple[Any, Any] | None = None  # (cache, NativeDecodeStep or None)
        per_type = hasattr(self.rotary, "layer_types")
        owners: list[tuple[_Layer, dict[str, list[torch.nn.Linear]]]] = []
        sparse_owners: list[tuple[MoEFeedForward, SparseParts]] = []  # (feed-forward, the model's block)
        for dec in base.layers:
            attn, mlp = dec.self_attn, dec.mlp
            lay = _Layer()
            lay.idx = int(attn.layer_idx)
            # Sandwich norms (Gemma): input -> attention -> post_attention -> residual, then
            # pre_feedforward -> MLP -> post_feedforward -> residual.
            pre_mlp = dec.pre_feedforward_layernorm if family.sandwich else dec.post_attention_layernorm
            lay.ln1, lay.eps1 = norm_weight(dec.input_layernorm), _eps(dec.input_layernorm)
            lay.ln2, lay.eps2 = norm_weight(pre_mlp), _eps(pre_mlp)
            lay.post_attn = norm_weight(dec.post_attention_layernorm) if family.sandwich else None
            lay.post_mlp = norm_weight(dec.post_feedforward_layernorm) if family.sandwich else None
            lay.post_eps = _eps(dec.post_attention_layernorm)
            lay.gelu = family.act == "gelu_pytorch_tanh"
            lay.act = self.ops.gelu_tanh_mul if lay.gelu else self.ops.silu_mul
            lay.rope = attn.layer_type if per_type else None
            sparse = moe_parts(mlp)
            lay.moe, lay.gu, lay.down = None, None, None
            if weights is not None:
                given = weights.layers[len(self.layers)]
                lay.qkv, lay.o = given["qkv"], given["o"]
                if sparse is not None:
                    lay.moe = given_experts(given, sparse, lay.act)
                else:
                    lay.gu, lay.down = given["gu"], given["down"]
            else:
                qkv = [attn.qkv_proj] if hasattr(attn, "qkv_proj") else [attn.q_proj, attn.k_proj, attn.v_proj]
                lay.qkv, lay.o = _TorchLinear(*_fuse(qkv)), _TorchLinear(attn.o_proj.weight, attn.o_proj.bias)
                parts: dict[str, list[torch.nn.Linear]] = {"qkv": qkv, "o": [attn.o_proj]}
                if sparse is not None:
                    lay.moe = _experts(sparse, lay.act)
                    sparse_owners.append((lay.moe, sparse))
                else:
                    gu = [mlp.gate_up_proj] if hasattr(mlp, "gate_up_proj") else [mlp.gate_proj, mlp.up_proj]
                    lay.gu, lay.down = _TorchLinear(*_fuse(gu)), _TorchLinear(mlp.down_proj.weight, mlp.down_proj.bias)
                    parts |= {"gu": gu, "down": [mlp.down_proj]}
                owners.append((lay, parts))
            lay.scaling = float(attn.scaling)
            # Qwen3's and Gemma 3's RMSNorm of each query and key head before RoPE (``build``
            # checked the pair).
            lay.q_norm = norm_weight(attn.q_norm) if hasattr(attn, "q_norm") else None
            lay.k_norm = norm_weight(attn.k_norm) if hasattr(attn, "k_norm") else None
            lay.qk_eps = _eps(attn.q_norm) if hasattr(attn, "q_norm") else 0.0
            # gpt-oss: one learned logit per query head in each softmax's denominator (``build`` checked its size).
            sinks = getattr(attn, "sinks", None)
            lay.sinks = sinks.detach().float().contiguous() if isinstance(sinks, torch.Tensor) else None
            # Qwen2 sets a window per layer; Mistral reads the config's for every layer.
            lay.window = (getattr(attn, "sliding_window", None) if hasattr(attn, "sliding_window")
                          else getattr(cfg, "sliding_window", None) if cfg.model_type in _CONFIG_WINDOW else None)
            self.layers.append(lay)
        self.rope_kinds = list(dict.fromkeys(lay.rope for lay in self.layers))
        # Packing (which empties the transformers modules' weights) only once every layer has
        # been understood: a refusal above leaves the model intact for transformers' forward.
        for lay, parts in owners if pack else ():
            for name, mods in parts.items():
                setattr(lay, name, _packed(getattr(lay, name), mods, compact))
        for moe, sp in sparse_owners if pack else ():
            _pack_experts(moe, sp, compact)

    @classmethod
    def build(cls, model: Any, pack: bool = False, ops: Any = None, compact: bool = True,
              native_decode: bool = True, weights: Any = None) -> "FusedDecoder | None":
        """A fused decoder for ``model``, or None when it is not a plain Llama-style stack.
        ``pack``: move the projections into the native CPU kernel's layout where it applies
        (``compact``: as lossless 4- or 8-bit panels where those fit); ``ops``: the per-layer
        small operations (default: ``TorchOps``); ``native_decode``: run decode-only steps as
        one native call where every part is native; ``weights``: the projections and embedding
        to use instead of the model's own (a GGUF file's, ``gguf_model.GGUFParts``)."""
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        family = _FAMILIES.get(getattr(cfg, "model_type", None))
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
        if family is None or act != family.act:
            return None
        try:
            base = model.get_decoder()
            layers = list(base.layers)
            ok = all(hasattr(base, a) for a in ("embed_tokens", "rotary_emb", "norm")) and layers
            # Gemma's (1 + weight) norms follow transformers' fp32 arithmetic only in fp32.
            ok = ok and (not family.norm_offset or base.norm.weight.dtype == torch.float32)
            ok = ok and not getattr(cfg, "attn_logit_softcapping", None)
            ok = ok and not getattr(cfg, "use_bidirectional_attention", False)
            # RoPE over whole heads only (Phi-4-mini rotates three quarters of each: transformers' forward).
            rope = getattr(cfg, "rope_parameters", None) or {}
            ok = ok and float(rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))) == 1.0
            for dec in layers:
                parts = {n for n, _ in dec.named_children()}
                ok = ok and parts in (_SANDWICH_PARTS if family.sandwich else _LAYER_PARTS, _DROPOUT_PARTS)
                attn_parts = {n for n, _ in dec.self_attn.named_children()}
                ok = ok and (attn_parts <= _ATTN_PARTS or attn_parts <= _FUSED_ATTN_PARTS)
                ok = ok and ({n for n, _ in dec.mlp.named_children()} in (_MLP_PARTS, _FUSED_MLP_PARTS)
                             or moe_parts(dec.mlp) is not None)
                ok = ok and all(_is_rms_norm(getattr(dec, n)) for n in parts if n.endswith("layernorm"))
                projections = ("qkv_proj", "o_proj") if "qkv_proj" in attn_parts else ("q_proj", "k_proj", "v_proj",
                                                                                       "o_proj")
                ok = ok and all(isinstance(getattr(dec.self_attn, p), torch.nn.Linear) for p in projections)
                ok = ok and cls._qk_norms_fit(dec.self_attn, cfg)
                sinks = getattr(dec.self_attn, "sinks", None)
                ok = ok and (sinks is None or tuple(sinks.shape) == (int(cfg.num_attention_heads),))
            ok = ok and _is_rms_norm(base.norm)
            if not ok:
                return None
            fused = cls(model, cfg, pack, ops, compact, native_decode, weights)
        except (AttributeError, TypeError, ValueError) as exc:
            log.info("fused decoder not used for %s: %s", type(model).__name__, exc)
            return None
        # The backend logs the whole execution plan (panels included) once the KV cache exists.
        log.debug("using the fused decoder forward for %s", type(model).__name__)
        return fused

    @staticmethod
    def _qk_norms_fit(attn: Any, cfg: Any) -> bool:
        """No q/k norms, or an RMSNorm over each head's vector for both with one epsilon."""
        norms = [getattr(attn, n, None) for n in ("q_norm", "k_norm")]
        if norms == [None, None]:
            return True
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        return (all(n is not None and _is_rms_norm(n) and tuple(n.weight.shape) == (head_dim,) for n in norms)
                and _eps(norms[0]) == _eps(norms[1]))

    def linears(self) -> list[Any]:
        """Every projection of the stack (the experts' too), for the plan line and the summary."""
        out: list[Any] = []
        for lay in self.layers:
            out += [lay.qkv, lay.o, lay.gu, lay.down]
            if lay.moe is not None:
                out += lay.moe.linears()
        return [lin for lin in out if lin is not None]

    def _rotary(self, x: torch.Tensor, positions: torch.Tensor, kind: str | None) -> tuple[torch.Tensor, ...]:
        """cos/sin ``[T, D]`` of ``positions`` from the model's rotary module (for RoPE ``kind``)."""
        cos, sin = self.rotary(x, positions[None]) if kind is None else self.rotary(x, positions[None], kind)
        cos, sin = cos[0], sin[0]
        if cos.shape[-1] * 2 == self.head_dim:  # gpt-oss's module gives each angle once, not once per half
            cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
        return cos.contiguous(), sin.contiguous()

    def tabulate_rope(self, max_len: int, dtype: torch.dtype) -> bool:
        """Compute cos/sin for positions ``0 .. max_len - 1`` once (in ``dtype``), through the
        model's own rotary module; False (nothing kept) for a length-dependent RoPE type."""
        kinds = getattr(self.rotary, "rope_type", "default")
        if any(k not in _STATIC_ROPE for k in (kinds.values() if isinstance(kinds, dict) else [kinds])):
            return False
        device = self.norm_w.device
        probe, positions = torch.empty(1, dtype=dtype, device=device), torch.arange(max_len, device=device)
        self.rope_table = {kind: self._rotary(probe, positions, kind) for kind in self.rope_kinds}
        return True

    def native_step(self, cache: PagedKVCache) -> Any:
        """The one-call native decode step over ``cache`` (built once per cache), or None when
        it is turned off or some part of the forward is not native."""
        if not self.native_decode or self.reduce is not None or any(lay.sinks is not None for lay in self.layers):
            return None
        if self._native is None or self._native[0] is not cache:
            from .native.step import NativeDecodeStep

            self._native = (cache, NativeDecodeStep.build(self, cache))
        return self._native[1]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                meta: StepMetadata, images: tuple[torch.Tensor, torch.Tensor] | None = None,
                rope: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids``/``positions`` ``[T]`` -> final hidden states ``[T, hidden]``; writes the KV.
        ``images``: (rows, features) fed instead of those rows' token embeddings (a vision model's);
        ``rope``: ``[3, T]`` positions by axis for a multimodal RoPE (mrope.py)."""
        T = input_ids.shape[0]
        H, kvh, D = self.heads, self.kv_heads, self.head_dim
        q_end, k_end = H * D, (H + kvh) * D
        h = self.embed(input_ids)
        deep = vision.splice(h, images)  # a vision model's image features; Qwen3-VL's deeper ones go in below
        table = self.rope_table
        ropes = mrope.select_ropes(lambda pos, kind: (table[kind][0][pos], table[kind][1][pos]) if table is not None
                                   else self._rotary(h, pos, kind), self.rope_kinds, positions, rope, self.mrope_axes)
        if meta.num_decode == T and not meta.prefills:
            native = self.native_step(cache)
            if native is not None:
                return native(h, ropes, meta)
        ops = self.ops
        fused_store = cache.kernel_ops and hasattr(ops, "rope_store")
        delta = None  # what the previous layer's MLP adds to the residual stream h
        for lay in self.layers:
            cos, sin = ropes[lay.rope]
            x = ops.add_rms_norm(h, delta, lay.ln1, lay.eps1)                 # h += delta, norm
            qkv = lay.qkv(x)
            if lay.q_norm is not None:
                ops.qk_norm(qkv, H, kvh, D, lay.q_norm, lay.k_norm, lay.qk_eps)
            if fused_store:  # RoPE and the KV store in one operator
                ops.rope_store(qkv, H, kvh, D, cos, sin, cache.layers[lay.idx][1], meta.slot_mapping)
            else:
                ops.rope(qkv, H + kvh, D, cos, sin)   # queries and keys sit side by side in qkv
            qk = qkv[:, :k_end].view(T, H + kvh, D)
            v = qkv[:, k_end:].view(T, kvh, D)
            o = paged_attention(cache, meta, lay.idx, qk[:, :H], qk[:, H:], v, lay.scaling, lay.window,
                                kv_written=fused_store, sinks=lay.sinks)
            # reshape, not view: CUDA's SDPA returns decode rows with heads apart in memory (no view merges them)
            attn_out = lay.o(o.reshape(T, q_end))
            if self.reduce is not None:
                self.reduce(attn_out)
            if lay.post_attn is not None:
                attn_out = ops.add_rms_norm(attn_out, None, lay.post_attn, lay.post_eps)
            x = ops.add_rms_norm(h, attn_out, lay.ln2, lay.eps2)
            delta = lay.moe(x) if lay.moe is not None else lay.down(lay.act(lay.gu(x)))
            if self.reduce is not None:
                self.reduce(delta)
            if lay.post_mlp is not None:
                delta = ops.add_rms_norm(delta, None, lay.post_mlp, lay.post_eps)
            if deep is not None and lay.idx < deep[1].shape[0]:  # added to the image rows' layer output
                delta = delta.index_add(0, deep[0], deep[1][lay.idx])
        return ops.add_rms_norm(h, delta, self.norm_w, self.norm_eps)
