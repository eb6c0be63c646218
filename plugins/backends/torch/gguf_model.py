"""GGUF models served in their own quantization: the file is memory-mapped and its projections
run through the native GGUF kernels (``native/gguf_ops.py``), so nothing is dequantized into an
fp32 copy and the resident memory stays close to the file's size.

Only the metadata goes through transformers (its GGUF config and tokenizer conversion, cached on
disk by the content of the file's header so a second start skips it). The transformers model is
built on the meta device as a skeleton the fused decoder reads its shapes and small tensors from:
the norms and biases are copied out of the file in fp32 and the rotary embedding is built on the
CPU; the four projections per layer, the input embedding and the output head are the file's own
tensors. Llama's GGUF files store Q and K with their rows permuted for llama.cpp's RoPE layout;
the permutation is undone by the kernels' row map, not by a copy.

``native_gguf_path(config, options)`` says whether a model takes this path; everything else
(other architectures, CUDA, bf16/fp16, ``--no-torch-gguf-native``, the CPU kernels off) keeps the
converted fp32 copy of ``loader.py``.
"""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from llmserve import progress
from llmserve import ModelConfig, ServerConfig
from llmserve import ConfigError

from .gguf_config import config_from_header, rope_factors
from .gguf_file import GGUFFile
from .gguf_metadata import metadata_dir
from .gguf_vision import projector
from .fused import _TorchLinear
from .moe import moe_parts
from .loader import (LoadedModel, _eos_ids, _resolve_source, load_error, load_tokenizer, resolve_device, resolve_dtype)

log = logging.getLogger("llmserve.backend.torch")

# GGUF architectures the fused decoder runs (llama.cpp files Mistral models as "llama").
# GGUF architectures of hybrid decoders (``fused_hybrid.HybridDecoder``; ``gguf_hybrid.HybridMapper``).
HYBRID = {"qwen35", "qwen35moe", "qwen3next", "lfm2"}
ARCHITECTURES = {"llama", "qwen2", "qwen2vl", "qwen3", "qwen3vl", "qwen3moe", "gemma3", "gemma4", "gpt-oss", *HYBRID}
# transformers' projection name -> the GGUF tensor name within block N.
_PROJECTIONS = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
                "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}
# A layer's norms: transformers' module -> the GGUF tensor within block N. Gemma 3 has four
# (its "ffn_norm" is the one before the MLP; post_attention_layernorm follows the attention).
_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
# gpt-oss: the norm before the MLP is filed as the attention's post-norm.
_POST_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm"}
_SANDWICH_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
                   "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
# Architectures whose norms scale by (1 + weight): llama.cpp's converter stores the sum.
_SHIFTED_NORMS = {"gemma3", "qwen35", "qwen35moe", "qwen3next"}


@dataclass
class GGUFParts:
    """What the fused decoder and the runner take from the file instead of fp32 weights."""

    layers: list[dict[str, Any]]        # per layer: qkv, o, gu, down (GGUF linears)
    embed: Callable[[torch.Tensor], torch.Tensor]  # token ids [T] -> fp32 [T, hidden]
    head: Any                            # the output projection (a GGUF linear)
    types: list[str] = field(default_factory=list)  # each projection matrix's GGUF type, lower case
    parameters: int = 0                  # every tensor's element count, summed
    weight_bytes: int = 0                # every tensor's bytes in the file, summed
    bf16_matmul: bool = False            # batches multiply in bf16 on AMX tiles (gguf_ops.gguf_linear)
    int8_decode: bool = False            # some linear quantizes decode activations to int8 (gguf_ops.gguf_linear)
    norms_shifted: bool = False          # norm weights stored as (1 + weight) (Gemma's, as llama.cpp writes them)
    model_parts: dict[str, Any] = field(default_factory=dict)  # an architecture's own (Gemma 4's per-layer table)


def _open(path: str) -> GGUFFile:
    try:
        return GGUFFile(path)
    except (ValueError, OSError) as exc:
        raise load_error(path, exc) from None


def native_gguf_path(config: ServerConfig, options: Any) -> str | None:
    """The GGUF file ``config`` serves when it takes the native path here, else None."""
    if not (getattr(options, "gguf_native", True) and options.cpu_kernels and options.fused_forward):
        return None
    source = config.llm.model
    if source is not None and not str(source).lower().endswith(".gguf"):
        return None
    if config.parallel.tensor_parallel_size > 1:
        return None
    device = resolve_device(config.llm.device)
    if device.type != "cpu" or resolve_dtype(config.llm.dtype, device) != torch.float32:
        return None
    if not _kernels_available():
        return None
    path, _ = _resolve_source(source)
    try:
        architecture = GGUFFile(path).architecture if path is not None else ""
    except (ValueError, OSError):
        return None  # the conversion path reads it, or says in its own words what is wrong
    return os.path.abspath(path) if architecture in ARCHITECTURES else None


def _kernels_available() -> bool:
    """Whether the native GGUF kernels run here (without them every matmul would dequantize
    its whole matrix, far slower than the fp32 copy)."""
    try:
        from .native import gguf_ops
    except ImportError:
        return False
    probe = gguf_ops.QuantTensor(qtype=0, data=torch.zeros(1, 128, dtype=torch.uint8), shape=(1, 32))  # one F32 row
    linear = gguf_ops.gguf_linear([probe])
    return linear is not None and bool(linear.kernel)


def prepare(path: str, cache_dir: str | None) -> None:
    """What ``llmserve warmup`` does for a GGUF served natively: check its tensor types and
    cache its config and tokenizer."""
    f = _File(path)
    metadata_dir(path, f.header, cache_dir)


def _permutation(rows: int, heads: int) -> torch.Tensor:
    """The stored row of each output of a llama Q or K matrix: llama.cpp's converter interleaves
    the two rotary halves of every head, ``(head, half, i) -> (head, i, half)``."""
    dim = rows // heads // 2
    return torch.arange(rows, dtype=torch.int32).view(heads, dim, 2).transpose(1, 2).reshape(rows).contiguous()


class _File:
    """The memory-mapped tensors of one GGUF file, by name."""

    def __init__(self, path: str) -> None:
        from .native import gguf_ops

        self.ops = gguf_ops
        header = self.header = _open(path)
        self.data_offset, self.architecture, self.tensors = header.data_offset, header.architecture, header.tensors
        self.fields_end = header.fields_end
        self.fields = header.fields
        for t in self.tensors.values():  # refused at load, in one line, before anything is built
            if t.tensor_type not in gguf_ops.SUPPORTED:
                raise ConfigError(gguf_ops.unsupported_error(t.tensor_type, t.name))

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def quant(self, name: str, rows: torch.Tensor | None = None) -> Any:
        """The 2-D tensor ``name`` as the kernels' QuantTensor (its bytes stay in the mapping);
        ``rows``: the stored row each output reads (a reordering, or a subset)."""
        t = self.tensors[name]
        if len(t.shape) != 2:
            raise ConfigError(f"GGUF tensor {name} has shape {list(t.shape)}, expected a matrix")
        k, n = (int(d) for d in t.shape)  # GGUF lists the fastest-moving dimension first
        raw = t.data.reshape(n, -1)
        with warnings.catch_warnings():  # the mapping is read-only, and the kernels only read it
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(raw)
        return self.ops.QuantTensor(qtype=int(t.tensor_type), data=data, shape=(n if rows is None else len(rows), k),
                                    rows=rows)

    def experts(self, name: str, count: int, rows: int, cols: int) -> list[Any]:
        """The 3-D tensor ``name`` (``count`` experts of ``rows x cols``) as one QuantTensor per
        expert, each a slice of the mapping (never copied: an expert no token picks stays on disk)."""
        t = self.tensors[name]
        shape = [int(d) for d in t.shape]  # fastest-moving first: [cols, rows, experts]
        if shape != [cols, rows, count]:
            raise ConfigError(f"GGUF tensor {name} has shape {shape}; the metadata gives {count} experts of "
                              f"{rows} x {cols} (the file is inconsistent)")
        raw = t.data.reshape(count * rows, -1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(raw)
        return [self.ops.QuantTensor(qtype=int(t.tensor_type), data=data[e * rows:(e + 1) * rows], shape=(rows, cols))
                for e in range(count)]

    def vector(self, name: str) -> torch.Tensor:
        """A 1-D tensor (a norm's weight, a bias) as an fp32 copy."""
        import numpy as np
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        t = self.tensors[name]
        values = dequantize(np.asarray(t.data), GGMLQuantizationType(t.tensor_type))
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(-1))


def _skeleton(config: Any) -> Any:
    """The transformers model on the meta device (no weight memory), with a CPU rotary embedding."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    base = model.get_decoder()
    base.rotary_emb = type(base.rotary_emb)(config=config)  # inv_freq computed on the CPU
    return model.eval().requires_grad_(False)


def _parameter(module: Any, name: str, value: torch.Tensor) -> None:
    setattr(module, name, torch.nn.Parameter(value, requires_grad=False))


def load_native(model_cfg: ModelConfig, path: str, bf16_matmul: bool = False,
                activations: str = "fp32") -> tuple[LoadedModel, GGUFParts]:
    """The model of the GGUF file at ``path`` with its weights left in the file's quantization;
    ``bf16_matmul``: the linears take the bf16 AMX path for batches; ``activations``: what
    decode steps multiply (``TorchOptions.gguf_decode_activations``: int8, fp32 or auto)."""
    from transformers import AutoConfig

    t0 = time.monotonic()
    source = model_cfg.model
    _, name = _resolve_source(source)
    gguf_file = _File(path)
    meta = metadata_dir(path, gguf_file.header, model_cfg.cache_dir)
    model_config = AutoConfig.from_pretrained(meta)
    config_from_header(model_config, gguf_file)
    tokenizer = load_tokenizer(model_cfg, meta, name)
    model = _skeleton(model_config)
    rope_factors(model, gguf_file)
    parts = _map_weights(model, model_config, gguf_file, gguf_file.architecture == "llama", bf16_matmul,
                         activations)
    parts.parameters = sum(math.prod(t.shape) for t in gguf_file.tensors.values())
    parts.weight_bytes = sum(t.data.nbytes for t in gguf_file.tensors.values())
    del gguf_file  # the reader and its fields; the tensors keep their own references to the mapping
    log.info("loaded %s (GGUF %s, read from the file) in %.1f s", name,
             ",".join(sorted(set(parts.types))), time.monotonic() - t0)
    native = int(getattr(model_config, "max_position_embeddings", None) or 2048)
    wanted = model_cfg.max_model_len
    if wanted and wanted > native:
        log.warning("max_model_len %d exceeds the model's %d positions; using %d", wanted, native, native)
    lm = LoadedModel(
        model=model, tokenizer=tokenizer, name=name, path=path,
        max_model_len=min(int(wanted or native), native),
        vocab_size=int(model_config.vocab_size), eos_token_ids=_eos_ids(model, tokenizer),
        chat_template=getattr(tokenizer, "chat_template", None), dtype=torch.float32, device=torch.device("cpu"),
    )
    # A vision model's projector file (named, or beside the model): its images (gguf_vision.py).
    lm.vision_model, lm.processor = projector(path, model_cfg.mmproj, model_config, tokenizer) or (None, None)
    return lm, parts


class _Mapper:
    """Builds the GGUF linears of one file and fills the skeleton's small tensors from it, with
    the names llama.cpp's converter gives them (``blk.N.attn_q.weight``, ...)."""

    def __init__(self, f: _File, cfg: Any, bf16: bool, activations: str = "fp32") -> None:
        self.f, self.cfg, self.ops, self.bf16, self.activations = f, cfg, f.ops, bf16, activations
        self.int8_used = False  # some product took the int8 decode path
        self.types: list[str] = []  # each matrix's type, lower case
        self.heads = int(cfg.num_attention_heads)
        # (A config with per-layer head counts, Gemma 4's, has no one count: its mapper reads each layer's.)
        self.kv_heads = 0 if getattr(cfg, "is_heterogeneous", False) else int(
            getattr(cfg, "num_key_value_heads", None) or self.heads)

    def need(self, name: str) -> str:
        if name not in self.f:
            raise ConfigError(f"GGUF file lacks tensor {name}; it is not a complete {self.cfg.model_type} model")
        return name

    def fill(self, module: Any, name: str) -> None:
        """A norm's weight from the file, of the size the config gives it."""
        value = self.f.vector(self.need(name))
        if value.numel() != module.weight.numel():
            raise ConfigError(f"GGUF tensor {name} has {value.numel()} values where a {self.cfg.model_type} model "
                              f"of this configuration has {module.weight.numel()}; the file is inconsistent")
        _parameter(module, "weight", value)

    def product(self, quants: list[Any], bias: torch.Tensor | None, name: str) -> Any:
        self.types.extend(self.ops.SUPPORTED[q.qtype].lower() for q in quants)
        # auto: Q8_0 weights keep exact activations (a file's precise matrices; on the embedded
        # SmolLM2 the output head, where int8 moved a near tie of its greedy answers).
        int8 = self.activations == "int8" or (
            self.activations == "auto" and all(q.qtype != self.ops.Q8_0 for q in quants))
        lin = self.ops.gguf_linear(quants, bias, bf16=self.bf16, int8=int8)
        if lin is None:
            raise ConfigError(f"the native GGUF kernels cannot run {name}; serve this model with "
                              "--no-torch-gguf-native (an fp32 copy)")
        self.int8_used |= lin.activations == "int8" and any(q.qtype in self.ops.INT8_TYPES for q in quants)
        return lin

    def linear(self, names: list[str], rows: list[torch.Tensor | None] | None = None,
               bias: torch.Tensor | None = None, shapes: list[tuple[int, int]] | None = None) -> Any:
        """The product of the matrices ``names`` stacked along their outputs; ``shapes``: the
        (outputs, inputs) the config gives each, checked before anything is built."""
        rows = rows or [None] * len(names)
        quants = [self.f.quant(self.need(n), r) for n, r in zip(names, rows)]
        for name, q, want in zip(names, quants, shapes or []):
            if tuple(q.shape) != tuple(want):
                raise ConfigError(f"GGUF tensor {name} is {q.shape[0]} x {q.shape[1]}; a {self.cfg.model_type} model "
                                  f"of this configuration has {want[0]} x {want[1]} (the file is inconsistent)")
        lin = self.product(quants, bias, names[0])
        progress.advance(len(names))
        return lin

    def expert_biases(self, name: str, count: int, size: int) -> list[torch.Tensor | None]:
        """Each expert's bias of the 3-D tensor ``name`` (``[count, size]`` as ``ffn_*_exps.bias``),
        or Nones where the file has none."""
        if name not in self.f:
            return [None] * count
        values = self.f.vector(name)
        if values.numel() != count * size:
            raise ConfigError(f"GGUF tensor {name} has {values.numel()} values; {count} experts of {size} need "
                              f"{count * size} (the file is inconsistent)")
        return list(values.view(count, size))

    def experts(self, blk: str) -> dict[str, Any]:
        """A sparse layer's router and its experts' gate-and-up and down products (biased where
        the file has biases: gpt-oss; gate and up as one tensor where the file merges them), and
        the shared expert's products where the file has one (Qwen3.5-MoE)."""
        cfg, f = self.cfg, self.f
        gpt_oss = cfg.model_type == "gpt_oss"
        count = int(cfg.num_local_experts if gpt_oss else cfg.num_experts)
        inter = int(cfg.intermediate_size if gpt_oss else cfg.moe_intermediate_size)
        hidden = int(cfg.hidden_size)
        gate_b, up_b = (self.expert_biases(f"{blk}ffn_{p}_exps.bias", count, inter) for p in ("gate", "up"))
        down_b = self.expert_biases(f"{blk}ffn_down_exps.bias", count, hidden)
        if (merged := f"{blk}ffn_gate_up_exps.weight") in f:  # each expert's gate rows, then its up rows
            parts = [[gu] for gu in f.experts(merged, count, 2 * inter, hidden)]
        else:
            gate, up = (f.experts(self.need(f"{blk}ffn_{p}_exps.weight"), count, inter, hidden)
                        for p in ("gate", "up"))
            parts = [[g, u] for g, u in zip(gate, up)]
        gate_up = [self.product(p, None if gb is None else torch.cat((gb, ub)), blk + "ffn_gate_exps")
                   for p, gb, ub in zip(parts, gate_b, up_b)]
        down = f.experts(self.need(f"{blk}ffn_down_exps.weight"), count, hidden, inter)
        router_b = f.vector(blk + "ffn_gate_inp.bias") if blk + "ffn_gate_inp.bias" in f else None
        out = {"router": self.linear([blk + "ffn_gate_inp.weight"], bias=router_b, shapes=[(count, hidden)]),
               "gate_up": gate_up,
               "down": [self.product([d], b, blk + "ffn_down_exps") for d, b in zip(down, down_b)]}
        progress.advance(2)  # with the router: the seven matrices a dense layer counts
        if getattr(cfg, "shared_expert_intermediate_size", None):
            out["shared"] = self.shared_expert(blk, int(cfg.shared_expert_intermediate_size), hidden)
        return out

    def shared_expert(self, blk: str, inter: int, hidden: int) -> tuple[Any, Any, Any]:
        """The shared expert's gate-and-up and down products and its gate (``ffn_gate_inp_shexp``:
        one weight per hidden unit, kept in fp32)."""
        gate = self.f.vector(self.need(f"{blk}ffn_gate_inp_shexp.weight"))
        if gate.numel() != hidden:
            raise ConfigError(f"GGUF tensor {blk}ffn_gate_inp_shexp.weight has {gate.numel()} values where a "
                              f"{self.cfg.model_type} model of this configuration has {hidden} (the file is "
                              "inconsistent)")
        gate_up = self.linear([f"{blk}ffn_gate_shexp.weight", f"{blk}ffn_up_shexp.weight"],
                              shapes=[(inter, hidden)] * 2)
        down = self.linear([f"{blk}ffn_down_shexp.weight"], shapes=[(hidden, inter)])
        return gate_up, down, _TorchLinear(gate.view(1, hidden), None)

    def final_norm(self, base: Any) -> None:
        self.fill(base.norm, "output_norm.weight")

    def model_parts(self, base: Any) -> dict[str, Any]:
        """Tensors of the whole model beside the layers, the embedding and the head (none here)."""
        return {}

    def layer(self, i: int, dec: Any, permuted: bool) -> dict[str, Any]:
        """Decoder layer ``i``'s linears (its norms and biases filled into ``dec``)."""
        f, blk, attn = self.f, f"blk.{i}.", dec.self_attn
        norms = (_SANDWICH_NORMS if hasattr(dec, "pre_feedforward_layernorm")
                 else _POST_NORMS if self.f.architecture == "gpt-oss" else _NORMS)
        for module, tensor in norms.items():
            self.fill(getattr(dec, module), f"{blk}{tensor}.weight")
        if hasattr(attn, "sinks"):  # gpt-oss: one logit per query head
            sinks = f.vector(self.need(f"{blk}attn_sinks.weight"))
            if sinks.numel() != self.heads:
                raise ConfigError(f"GGUF tensor {blk}attn_sinks.weight has {sinks.numel()} values for {self.heads} "
                                  "attention heads (the file is inconsistent)")
            _parameter(attn, "sinks", sinks)
        for norm in ("q_norm", "k_norm"):  # Qwen3's and Gemma 3's per-head norms (head_dim values each)
            if hasattr(attn, norm):
                self.fill(getattr(attn, norm), f"{blk}attn_{norm}.weight")
        w = {p: blk + g + ".weight" for p, g in _PROJECTIONS.items()}
        qk_rows: list[torch.Tensor | None] = [None, None, None]
        if permuted:
            q_out, k_out = (int(f.tensors[w[p]].shape[1]) for p in ("q", "k"))
            qk_rows = [_permutation(q_out, self.heads), _permutation(k_out, self.kv_heads), None]
        biases = [blk + g + ".bias" for g in ("attn_q", "attn_k", "attn_v")]
        qkv_bias = None
        if any(b in f for b in biases):
            qkv_bias = torch.cat([f.vector(self.need(b)) for b in biases])
            for proj, b in zip((attn.q_proj, attn.k_proj, attn.v_proj), biases):
                if proj.bias is not None:
                    _parameter(proj, "bias", f.vector(b))
        hidden = int(self.cfg.hidden_size)
        head_dim = int(getattr(self.cfg, "head_dim", None) or hidden // self.heads)
        q_out, kv_out = self.heads * head_dim, self.kv_heads * head_dim
        out = {"qkv": self.linear([w["q"], w["k"], w["v"]], qk_rows, qkv_bias,
                                  [(q_out, hidden), (kv_out, hidden), (kv_out, hidden)]),
               "o": self.linear([w["o"]], bias=f.vector(o_bias) if (o_bias := blk + "attn_output.bias") in f else None,
                                shapes=[(hidden, q_out)])}
        if moe_parts(dec.mlp) is not None:
            return out | self.experts(blk)
        inter = int(self.cfg.intermediate_size)
        return out | {"gu": self.linear([w["gate"], w["up"]], shapes=[(inter, hidden)] * 2),
                      "down": self.linear([w["down"]], shapes=[(hidden, inter)])}


def _map_weights(model: Any, cfg: Any, f: _File, permuted: bool, bf16: bool = False,
                 activations: str = "fp32") -> GGUFParts:
    """Fill the skeleton's small tensors from ``f`` and build the GGUF linears (``permuted``:
    Q and K rows in llama.cpp's rotary order, undone by a row map; ``activations``: what decode
    steps multiply, ``load_native``'s)."""
    ops = f.ops
    base = model.get_decoder()
    if bf16 and not ops.amx_available():
        log.warning("gguf_bf16_matmul: this CPU (or kernel) offers no AMX tiles; the exact fp32 kernels run")
        bf16 = False
    elif not bf16 and ops.amx_available():
        log.info("this CPU has AMX tiles: --torch-gguf-bf16-matmul multiplies prefill and batches in bf16, "
                 "several times faster than the exact fp32 kernels (see docs/engine.md, GGUF models)")
    from .gguf_gemma4 import Gemma4Mapper
    from .gguf_hybrid import HybridMapper

    mapper = (HybridMapper if f.architecture in HYBRID else Gemma4Mapper if f.architecture == "gemma4"
              else _Mapper)(f, cfg, bf16, activations)
    n_layers = int(cfg.num_hidden_layers)
    with progress.phase("mapping GGUF weights", 7 * n_layers + 1, "matrices"):
        layers = [mapper.layer(i, dec, permuted) for i, dec in enumerate(base.layers)]
        if len(layers) != n_layers:
            raise ConfigError(f"GGUF file has {len(layers)} layers, its metadata says {n_layers}")
        mapper.final_norm(base)
        own = mapper.model_parts(base)
        embed_t = f.quant(mapper.need("token_embd.weight"))
        head = mapper.linear(["output.weight" if "output.weight" in f else "token_embd.weight"])
    gguf_rows = ops.gguf_rows

    def embed(ids: torch.Tensor) -> torch.Tensor:
        return gguf_rows(embed_t, ids)

    return GGUFParts(layers=layers, embed=embed, head=head, types=mapper.types, bf16_matmul=bf16,
                     int8_decode=mapper.int8_used, norms_shifted=f.architecture in _SHIFTED_NORMS, model_parts=own)
