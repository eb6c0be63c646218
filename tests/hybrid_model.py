"""Tiny hybrid models for the tests: Qwen3.5 (dense and MoE) and Qwen3-Next shapes with random
weights (three Gated DeltaNet layers, then one gated full-attention layer), LFM2's (three
short-convolution layers, then one attention layer) and Granite 4.0-H's (three Mamba2 layers, then
one attention layer), saved with the word tokenizer, and
transformers' own logits and greedy continuations to hold the engine to.

The weights are drawn so the recurrent layers matter: decay rates from fast to slow, norms away
from one, and an output embedding scaled so the logits spread widely (every greedy step of the
reference has a clear winner, so rounding never decides a token).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from backends.test_torch_paged import VOCAB, save_word_tokenizer

TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, initializer_range=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=2)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
VISION = dict(depth=1, hidden_size=32, num_heads=2, out_hidden_size=64, intermediate_size=64)
# name -> (model_type, config beyond TEXT); "qwen3_5" is a whole Qwen3.5 checkpoint (vision tower
# and all, as the Hub's are), of which the engine serves the language model.
SHAPES: dict[str, tuple[str, dict]] = {
    "qwen3_5_text": ("qwen3_5_text", {}),
    "qwen3_5_moe_text": ("qwen3_5_moe_text", MOE),
    "qwen3_next": ("qwen3_next", MOE),
    "qwen3_5": ("qwen3_5", {}),
    "lfm2": ("lfm2", dict(layer_types=["conv", "conv", "conv", "full_attention"], full_attn_idxs=[3], conv_L_cache=3,
                          conv_bias=True, block_auto_adjust_ff_dim=False)),
    # LFM2-MoE: a dense feed-forward in the first layer, experts (a sigmoid router with expert bias) after.
    "lfm2_moe": ("lfm2_moe", dict(layer_types=["conv", "conv", "conv", "full_attention"], conv_L_cache=3,
                                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_dense_layers=1)),
    # Granite 4.0-H: Mamba2 layers of 4 heads of 32 in 2 groups, experts beside a shared MLP, and
    # Granite's multipliers away from one.
    "granitemoehybrid": ("granitemoehybrid", dict(
        layer_types=["mamba", "mamba", "mamba", "attention"], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16,
        mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2, num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=96, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2,
        logits_scaling=2.0)),
    "bamba": ("bamba", dict(attn_layer_indices=[3], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16,
                            mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2)),
    # Nemotron-H: Mamba2, MLP, MoE and attention blocks, each a layer (2 groups of 2 heads of 32).
    "nemotron_h": ("nemotron_h", dict(
        layers_block_type=["mamba", "mlp", "mamba", "moe", "attention", "mamba"], mamba_num_heads=4,
        mamba_head_dim=32, ssm_state_size=16, n_groups=2, conv_kernel=4, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=1, topk_group=1)),
}
LOGIT_SPREAD = 8.0
MIN_MARGIN = 1e-3


def _stir(model: torch.nn.Module) -> None:
    """Decays from fast to slow and norms away from one: the state carries far back and
    each layer's parts all matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-4.0, 1.0)
            elif name.endswith("dt_bias"):
                p.normal_(0.0, 1.0)
            elif "norm" in name and name.endswith("weight"):
                p.normal_(0.0 if "linear_attn" not in name else 1.0, 0.3)
            elif name.endswith("conv.bias"):
                p.normal_(0.0, 0.3)


def write_hybrid(name: str, path: str, seed: int = 0) -> torch.nn.Module:
    """Save the tiny model ``name`` (``SHAPES``) to ``path``; returns the language model as
    transformers serves it (``AutoModelForCausalLM`` over the saved directory), in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

    arch, extra = SHAPES[name]
    torch.manual_seed(seed)
    if arch == "qwen3_5":
        cfg = AutoConfig.for_model(arch, text_config=dict(TEXT, **extra), vision_config=VISION)
        model: torch.nn.Module = Qwen3_5ForConditionalGeneration(cfg)
        lm = model.model.language_model
        head = model.lm_head
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **TEXT, **extra), dtype=torch.float32)
        lm, head = model.model, model.lm_head
    _stir(model)
    ids = torch.randint(3, VOCAB, (1, 64), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        spread = float(head(lm(ids).last_hidden_state).std())
        head.weight.mul_(LOGIT_SPREAD / spread)
    model.save_pretrained(path)
    save_word_tokenizer(path)
    served = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    served.generation_config.eos_token_id = None  # the engine runs with ignore_eos: neither stops early
    return served


def reference_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' logits ``[len(ids), vocab]`` of one pass over ``ids``."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def reference_generate(model: torch.nn.Module, ids: list[int], max_new: int) -> list[int]:
    """transformers' greedy continuation of ``ids`` (its own recurrent cache), checked free of
    near ties."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new, pad_token_id=2,
                             output_scores=True, return_dict_in_generate=True)
    margins = [float(top[0] - top[1]) for top in (s[0].topk(2).values for s in out.scores)]
    assert min(margins) >= MIN_MARGIN, f"a near tie in the reference ({min(margins):.1e}): change the seed"
    return out.sequences[0, len(ids):].tolist()


def _tiled(x: np.ndarray, axis: int, key_heads: int, per_key: int, size: int) -> np.ndarray:
    """Value heads along ``axis`` (``key_heads * per_key`` heads of ``size``) from grouped order
    (by key head, as checkpoints keep them) to tiled order (head ``v`` of every key head, then the
    next: llama.cpp's converter's order)."""
    moved = np.moveaxis(x, axis, 0)
    rest = moved.shape[1:]
    tiled = moved.reshape(key_heads, per_key, size, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.ascontiguousarray(np.moveaxis(tiled, 0, axis))


def _mlp_tensors(sd: dict, pre: str, blk: str, merged: bool) -> dict[str, np.ndarray]:
    """A layer's MLP as llama.cpp names it: one gated MLP, or (Qwen3.5-MoE) the router, the
    experts' 3-D tensors (gate and up apart, or ``merged`` into one) and the shared expert with
    its one-row gate (written as a vector)."""
    m = pre + "mlp."
    if m + "experts.gate_up_proj" not in sd:
        return {blk + "ffn_gate.weight": sd[m + "gate_proj.weight"], blk + "ffn_up.weight": sd[m + "up_proj.weight"],
                blk + "ffn_down.weight": sd[m + "down_proj.weight"]}
    gate_up, inter = sd[m + "experts.gate_up_proj"], sd[m + "experts.down_proj"].shape[-1]
    experts = ({blk + "ffn_gate_up_exps.weight": gate_up} if merged else
               {blk + "ffn_gate_exps.weight": gate_up[:, :inter], blk + "ffn_up_exps.weight": gate_up[:, inter:]})
    return {**experts, blk + "ffn_down_exps.weight": sd[m + "experts.down_proj"],
            blk + "ffn_gate_inp.weight": sd[m + "gate.weight"],
            blk + "ffn_gate_shexp.weight": sd[m + "shared_expert.gate_proj.weight"],
            blk + "ffn_up_shexp.weight": sd[m + "shared_expert.up_proj.weight"],
            blk + "ffn_down_shexp.weight": sd[m + "shared_expert.down_proj.weight"],
            blk + "ffn_gate_inp_shexp.weight": sd[m + "shared_expert_gate.weight"].reshape(-1)}


def _file_model(model_type: str, seed: int, **extra: object) -> tuple[torch.nn.Module, object, dict]:
    """A tiny ``model_type`` with the embedded SmolLM2's vocabulary (a GGUF file's), its weights
    stirred and its logits spread: the model (eval mode), its config and its float32 state dict."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, **dict(TEXT, vocab_size=49152, bos_token_id=None, eos_token_id=None,
                                                  pad_token_id=None), **extra)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    _stir(model)
    with torch.inference_mode():
        ids = torch.randint(3, 40000, (1, 64), generator=torch.Generator().manual_seed(seed))
        model.lm_head.weight.mul_(LOGIT_SPREAD / float(model(ids).logits.std()))
    model.generation_config.eos_token_id = None
    return model, cfg, {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def _write_tensors(w: object, tensors: dict, qtype: str, seed: int,
                   quantized: Callable[[str, np.ndarray], bool] | None = None) -> None:
    """The tensors (those ``quantized`` picks, by default ``_quantized``, in ``qtype``, the rest
    F32; None: left out), then the file is written and closed."""
    from gguf_writer import _encode

    rng = np.random.default_rng(seed)
    for name, value in tensors.items():
        if value is not None:
            data, raw = _encode(value, qtype if (quantized or _quantized)(name, value) else "F32", rng)
            w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _quantized(name: str, value: np.ndarray) -> bool:
    """Whether the converter's quantization rounds this tensor (matrices and experts; not the
    convolutions, not the router)."""
    return value.ndim >= 2 and "conv1d" not in name and "shortconv.conv" not in name and not name.endswith(
        "ffn_gate_inp.weight")


def _next_delta(sd: dict, la: str, blk: str, hk: int, dk: int, r: int, dv: int) -> dict[str, np.ndarray]:
    """A Qwen3-Next Gated DeltaNet layer as llama.cpp's converter writes it: the key-head groups of
    ``in_proj_qkvz`` split into every query, key and value (``attn_qkv``) and every gate
    (``attn_gate``), value heads left grouped; ``in_proj_ba`` as it is (``ssm_ba``)."""
    qkvz = sd[la + "in_proj_qkvz.weight"]
    q, k, v, z = np.split(qkvz.reshape(hk, 2 * dk + 2 * r * dv, -1), [dk, 2 * dk, 2 * dk + r * dv], axis=1)
    hidden = qkvz.shape[-1]
    return {blk + "attn_qkv.weight": np.concatenate([x.reshape(-1, hidden) for x in (q, k, v)]),
            blk + "attn_gate.weight": z.reshape(-1, hidden), blk + "ssm_ba.weight": sd[la + "in_proj_ba.weight"],
            blk + "ssm_a": -np.exp(sd[la + "A_log"]), blk + "ssm_dt.bias": sd[la + "dt_bias"],
            blk + "ssm_conv1d.weight": sd[la + "conv1d.weight"][:, 0, :],
            blk + "ssm_norm.weight": sd[la + "norm.weight"], blk + "ssm_out.weight": sd[la + "out_proj.weight"]}


# The GGUF architectures write_hybrid_gguf writes -> transformers' model type.
GGUF_KINDS = {"qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text", "qwen3next": "qwen3_next"}


def write_hybrid_gguf(path: str, qtype: str = "F32", seed: int = 0,
                      replace: dict[str, np.ndarray | None] | None = None, kind: str = "qwen35",
                      merged: bool = False, source: torch.nn.Module | None = None,
                      tokenizer: Callable[[Any], None] | None = None) -> torch.nn.Module:
    """A tiny Qwen3.5 text model (vocabulary and tokenizer of the embedded SmolLM2) saved as a
    ``qwen35`` GGUF file the way llama.cpp's converter writes one: ``A_log`` as ``-exp(A_log)``
    (``ssm_a``), ``dt_bias`` as ``ssm_dt.bias``, the convolution squeezed to ``[channels, K]``,
    every RMSNorm but the gated one stored as ``1 + weight``, the value heads in tiled order, each
    attention head's query and gate rows interleaved in ``attn_q``; matrices in ``qtype``.
    ``kind``: ``qwen35moe`` for Qwen3.5-MoE (experts and a shared expert, ``MOE``'s sizes;
    ``merged``: each expert's gate and up in one tensor), ``qwen3next`` for Qwen3-Next (as the
    MoE, its value heads grouped, F32 only). ``replace``: tensors written with these
    values instead (None: left out). ``source``: a model of ``kind`` to write instead of a random
    one (a vision model's language model; its rotary sections written as the converter writes
    them), ``tokenizer``: what writes the file's tokenizer fields instead of the embedded one's.
    Returns the model (transformers, float32, eval mode) the file was made from, holding its
    matrices as the file decodes them (a quantized ``qtype`` rounds them)."""
    import gguf
    from gguf_writer import _write_tokenizer

    torch.manual_seed(seed)
    moe, arch = kind != "qwen35", kind
    assert qtype == "F32" or kind != "qwen3next", "quantized qwen3next files are not written here"
    if source is None:
        model, cfg, sd = _file_model(GGUF_KINDS[kind], seed, **(MOE if moe else {}))
    else:
        model, cfg = source, source.config
        sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    r = hv // hk
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output.weight": sd["lm_head.weight"],
               "output_norm.weight": sd["model.norm.weight"] + 1}
    for i, layer_type in enumerate(cfg.layer_types):
        pre, blk = f"model.layers.{i}.", f"blk.{i}."
        tensors |= {blk + "attn_norm.weight": sd[pre + "input_layernorm.weight"] + 1,
                    blk + "post_attention_norm.weight": sd[pre + "post_attention_layernorm.weight"] + 1,
                    **_mlp_tensors(sd, pre, blk, merged)}
        if layer_type == "full_attention":
            a = pre + "self_attn."
            tensors |= {blk + "attn_q.weight": sd[a + "q_proj.weight"], blk + "attn_k.weight": sd[a + "k_proj.weight"],
                        blk + "attn_v.weight": sd[a + "v_proj.weight"],
                        blk + "attn_output.weight": sd[a + "o_proj.weight"],
                        blk + "attn_q_norm.weight": sd[a + "q_norm.weight"] + 1,
                        blk + "attn_k_norm.weight": sd[a + "k_norm.weight"] + 1}
            continue
        la = pre + "linear_attn."
        if kind == "qwen3next":
            tensors |= _next_delta(sd, la, blk, hk, dk, r, dv)
            continue
        qkv, conv = sd[la + "in_proj_qkv.weight"], sd[la + "conv1d.weight"][:, 0, :]
        qk = 2 * hk * dk
        tensors |= {
            blk + "attn_qkv.weight": np.concatenate([qkv[:qk], _tiled(qkv[qk:], 0, hk, r, dv)]),
            blk + "attn_gate.weight": _tiled(sd[la + "in_proj_z.weight"], 0, hk, r, dv),
            blk + "ssm_beta.weight": _tiled(sd[la + "in_proj_b.weight"], 0, hk, r, 1),
            blk + "ssm_alpha.weight": _tiled(sd[la + "in_proj_a.weight"], 0, hk, r, 1),
            blk + "ssm_a": _tiled(-np.exp(sd[la + "A_log"]), 0, hk, r, 1),
            blk + "ssm_dt.bias": _tiled(sd[la + "dt_bias"], 0, hk, r, 1),
            blk + "ssm_conv1d.weight": np.concatenate([conv[:qk], _tiled(conv[qk:], 0, hk, r, dv)]),
            blk + "ssm_norm.weight": sd[la + "norm.weight"],
            blk + "ssm_out.weight": _tiled(sd[la + "out_proj.weight"], 1, hk, r, dv)}
    if qtype != "F32":  # the reference gets the weights the file decodes to
        _round_trip(model, tensors, qtype, hk, r, dv)
    w = gguf.GGUFWriter(path, arch)
    head_dim = cfg.head_dim
    mlp = (dict(expert_count=cfg.num_experts, expert_used_count=cfg.num_experts_per_tok,
                expert_feed_forward_length=cfg.moe_intermediate_size,
                expert_shared_feed_forward_length=cfg.shared_expert_intermediate_size) if moe
           else dict(feed_forward_length=cfg.intermediate_size))
    for key, value in {"block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
                       "embedding_length": cfg.hidden_size, **mlp,
                       "attention.head_count": cfg.num_attention_heads,
                       "attention.head_count_kv": cfg.num_key_value_heads, "attention.key_length": head_dim,
                       "attention.value_length": head_dim, "ssm.conv_kernel": cfg.linear_conv_kernel_dim,
                       "ssm.state_size": dk, "ssm.group_count": hk, "ssm.time_step_rank": hv,
                       "ssm.inner_size": hv * dv, "full_attention_interval": 4,
                       "rope.dimension_count": int(head_dim * cfg.rope_parameters["partial_rotary_factor"])}.items():
        w.add_uint32(f"{arch}.{key}", int(value))
    w.add_float32(f"{arch}.rope.freq_base", float(cfg.rope_parameters["rope_theta"]))
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", float(cfg.rms_norm_eps))
    if source is not None and "mrope_section" in cfg.rope_parameters:
        w.add_rope_dimension_sections([*cfg.rope_parameters["mrope_section"], 0])
    (tokenizer or _write_tokenizer)(w)
    _write_tensors(w, {**tensors, **(replace or {})}, qtype, seed)
    return model


def _round_trip(model: torch.nn.Module, tensors: dict, qtype: str, hk: int, r: int, dv: int) -> None:
    """Quantize every matrix of ``tensors`` to ``qtype`` and back (in place), and put the rounded
    values into ``model``'s parameters, each undoing its file layout (tiled value heads back to
    grouped)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    t = GGMLQuantizationType[qtype]
    for name, value in tensors.items():
        if _quantized(name, value):
            tensors[name] = dequantize(quantize(value.astype(np.float32), t), t).reshape(value.shape)
    params = dict(model.named_parameters())

    def put(param: str, value: np.ndarray) -> None:
        with torch.no_grad():
            params[param].copy_(torch.from_numpy(np.ascontiguousarray(value)).view(params[param].shape))

    put("model.embed_tokens.weight", tensors["token_embd.weight"])
    put("lm_head.weight", tensors["output.weight"])
    qk = 2 * hk * (model.config.linear_key_head_dim)
    for i, kind in enumerate(model.config.layer_types):
        pre, blk = f"model.layers.{i}.", f"blk.{i}."
        if f"{blk}ffn_down_exps.weight" in tensors:
            gate_up = (tensors[blk + "ffn_gate_up_exps.weight"] if blk + "ffn_gate_up_exps.weight" in tensors else
                       np.concatenate([tensors[blk + "ffn_gate_exps.weight"], tensors[blk + "ffn_up_exps.weight"]], 1))
            put(f"{pre}mlp.experts.gate_up_proj", gate_up)
            put(f"{pre}mlp.experts.down_proj", tensors[blk + "ffn_down_exps.weight"])
            for proj, name in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
                put(f"{pre}mlp.shared_expert.{proj}.weight", tensors[f"{blk}{name}_shexp.weight"])
        else:
            for proj, name in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
                put(f"{pre}mlp.{proj}.weight", tensors[f"{blk}{name}.weight"])
        if kind == "full_attention":
            for proj, name in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                               ("o_proj", "attn_output")):
                put(f"{pre}self_attn.{proj}.weight", tensors[f"{blk}{name}.weight"])
            continue
        la = pre + "linear_attn."
        qkv = tensors[blk + "attn_qkv.weight"]
        put(la + "in_proj_qkv.weight", np.concatenate([qkv[:qk], _tiled(qkv[qk:], 0, r, hk, dv)]))
        put(la + "in_proj_z.weight", _tiled(tensors[blk + "attn_gate.weight"], 0, r, hk, dv))
        put(la + "in_proj_b.weight", _tiled(tensors[blk + "ssm_beta.weight"], 0, r, hk, 1))
        put(la + "in_proj_a.weight", _tiled(tensors[blk + "ssm_alpha.weight"], 0, r, hk, 1))
        put(la + "out_proj.weight", _tiled(tensors[blk + "ssm_out.weight"], 1, r, hk, dv))


def write_lfm2_gguf(path: str, seed: int = 0, replace: dict[str, np.ndarray | None] | None = None) -> torch.nn.Module:
    """A tiny LFM2 (``SHAPES["lfm2"]``: three short-convolution layers with biases, then one
    attention layer; the vocabulary and tokenizer of the embedded SmolLM2) saved as an F32 ``lfm2``
    GGUF file the way llama.cpp's converter writes one: the convolution squeezed to ``[channels,
    L]``, the final norm as ``token_embd_norm``, the KV head count per layer (0 for a convolution
    layer), norms as stored (LFM2's scale by ``weight``). ``replace`` as for ``write_hybrid_gguf``.
    Returns the model (transformers, float32, eval mode) the file was made from."""
    import gguf
    from gguf_writer import _write_tokenizer

    model, cfg, sd = _file_model("lfm2", seed, **SHAPES["lfm2"][1], norm_eps=1e-6,
                                 rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    names = {"operator_norm": "attn_norm", "ffn_norm": "ffn_norm", "feed_forward.w1": "ffn_gate",
             "feed_forward.w3": "ffn_up", "feed_forward.w2": "ffn_down", "conv.in_proj": "shortconv.in_proj",
             "conv.out_proj": "shortconv.out_proj", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_output",
             "self_attn.q_layernorm": "attn_q_norm", "self_attn.k_layernorm": "attn_k_norm"}
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output.weight": sd["lm_head.weight"],
               "token_embd_norm.weight": sd["model.embedding_norm.weight"]}
    for key, value in sd.items():
        parts = key.split(".")
        if parts[:2] != ["model", "layers"]:
            continue
        blk, module, kind = f"blk.{parts[2]}.", ".".join(parts[3:-1]), parts[-1]
        if module == "conv.conv":  # the depthwise convolution, squeezed
            tensors[f"{blk}shortconv.conv.{kind}"] = value[:, 0, :] if kind == "weight" else value
        else:
            tensors[f"{blk}{names[module]}.{kind}"] = value
    w = gguf.GGUFWriter(path, "lfm2")
    for key, v in {"block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
                   "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
                   "attention.head_count": cfg.num_attention_heads, "shortconv.l_cache": cfg.conv_L_cache,
                   "vocab_size": cfg.vocab_size}.items():
        w.add_uint32(f"lfm2.{key}", int(v))
    w.add_array("lfm2.attention.head_count_kv",
                [cfg.num_key_value_heads if t == "full_attention" else 0 for t in cfg.layer_types])
    w.add_float32("lfm2.rope.freq_base", 50000.0)
    w.add_float32("lfm2.attention.layer_norm_rms_epsilon", 1e-6)
    _write_tokenizer(w)
    _write_tensors(w, {**tensors, **(replace or {})}, "F32", seed)
    return model
