"""Hybrid models on the paged engine: the recurrent state of their Gated DeltaNet layers, one slot
per running sequence (``RecurrentStates``), what one step tells those layers (``StateStep``), and
the forward that takes the place of each such layer's own (``install``).

The engine hands every sequence a state slot (``StepItem.state_slot``); a slot starts empty when
its sequence's first token is fed. Per Gated DeltaNet layer a slot holds the convolution's window
(the last ``K - 1`` inputs of the short causal convolution, in the model's dtype) and the delta
rule's state (``[heads, Dk, Dv]``, float32). Saved states for the prefix cache sit in the same
tensors after the slots: a step may copy one into a slot before it runs (``state_restore``) and
save a slot's state at a given position of its chunk (``state_snapshot``). The full-attention
layers keep keys and values in the paged KV cache as every other model does;
``RecurrentStates.kv_layers`` maps their layer numbers to the cache's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F

from llmserve import StepItem

from . import deltanet, mamba2
from .attention import current_step

# Text model types whose recurrent layers this module runs: the Gated DeltaNet modules (Qwen3.5 and
# Qwen3.5-MoE project q, k, v / z / b / a separately, Qwen3-Next fuses them per key head), LFM2's
# and LFM2-MoE's short convolutions and the Mamba2 layers of Granite 4.0-H, Bamba and Nemotron-H.
HYBRID_TYPES = frozenset({"qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "lfm2", "lfm2_moe", "granitemoehybrid",
                          "bamba", "nemotron_h"})


@dataclass(frozen=True)
class DeltaNetShape:
    """What one Gated DeltaNet layer keeps per sequence."""

    conv_dim: int     # channels of the short convolution (queries, keys and values together)
    kernel: int       # its width K
    heads: int        # value heads (each with its own state)
    key_dim: int      # Dk
    value_dim: int    # Dv

    def bytes_per_slot(self, conv_dtype: torch.dtype) -> int:
        return (self.conv_dim * (self.kernel - 1) * conv_dtype.itemsize
                + self.heads * self.key_dim * self.value_dim * 4)


def _deltanet_layers(model: Any) -> list[tuple[int, Any]]:
    """(layer number, module) of every Gated DeltaNet layer of the loaded model, in order."""
    return [(int(m.layer_idx), m) for name, m in model.named_modules()
            if name.endswith("linear_attn") and hasattr(m, "A_log") and hasattr(m, "conv1d")]


def _short_conv_layers(model: Any) -> list[tuple[int, Any]]:
    """(layer number, module) of every short-convolution layer (LFM2's: gates around a depthwise
    causal convolution), in order."""
    return [(int(m.layer_idx), m) for name, m in model.named_modules()
            if name.endswith(".conv") and hasattr(m, "in_proj") and isinstance(getattr(m, "conv", None),
                                                                              torch.nn.Conv1d)]


def _mamba_layers(model: Any) -> list[tuple[int, Any]]:
    """(layer number, module) of every Mamba2 layer (Granite 4.0-H's and Bamba's ``mamba``,
    Nemotron-H's ``mixer``), in order."""
    return [(int(m.layer_idx), m) for name, m in model.named_modules()
            if name.endswith((".mamba", ".mixer")) and all(hasattr(m, a) for a in ("A_log", "D", "dt_bias", "conv1d",
                                                                                    "in_proj"))]


class Hybrid(NamedTuple):
    """What a hybrid model keeps: the shape of one recurrent layer's state, the recurrent layers'
    numbers, the attention layers' numbers and the recurrent layers' kind (for the plan line)."""

    shape: DeltaNetShape
    recurrent: list[int]
    attention: list[int]
    kind: str


def hybrid_shape(model: Any) -> Hybrid | None:
    """The model's recurrent layers (Gated DeltaNet or short convolutions) and attention layers;
    None for a model without such layers."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(cfg, "model_type", None) not in HYBRID_TYPES:
        return None
    if layers := _deltanet_layers(model):
        m = layers[0][1]
        shape = DeltaNetShape(conv_dim=int(m.conv_dim), kernel=int(m.conv_kernel_size), heads=int(m.num_v_heads),
                              key_dim=int(m.head_k_dim), value_dim=int(m.head_v_dim))
        kind, name = "gated-deltanet", "linear_attention"
    elif layers := _short_conv_layers(model):
        m = layers[0][1]
        shape = DeltaNetShape(conv_dim=int(m.conv.in_channels), kernel=int(m.conv_kernel_size), heads=0, key_dim=0,
                              value_dim=0)  # a window, no delta-rule state
        kind, name = "short-conv", "conv"
    elif layers := _mamba_layers(model):
        m = layers[0][1]  # a [head size, state size] state per head
        shape = DeltaNetShape(conv_dim=int(m.conv_dim), kernel=int(m.conv_kernel_size), heads=int(m.num_heads),
                              key_dim=int(m.head_dim), value_dim=int(m.ssm_state_size))
        kind, name = "mamba2", str(cfg.layer_types[layers[0][0]])
    else:
        return None
    recurrent = [i for i, _ in layers]
    kinds = list(cfg.layer_types)
    if recurrent != [i for i, k in enumerate(kinds) if k == name]:
        raise ValueError(f"the model's {kind} layers are not the ones its layer_types name")
    # Nemotron-H's MLP and MoE blocks are layers of their own, with neither state nor keys and values.
    attention = [i for i, k in enumerate(kinds) if k != name and k not in ("mlp", "moe")]
    return Hybrid(shape, recurrent, attention, kind)


@dataclass
class StateStep:
    """The recurrent layers' part of one step: the decode rows' slots (the first ``num_decode``
    packed rows, one token each) and the rows whose state is saved after them, (slot, row of the
    saved state); each prompt chunk's (first row, length, slot, tokens before the save or None,
    row of the saved state)."""

    states: "RecurrentStates"
    num_decode: int
    decode_slots: torch.Tensor | None
    decode_saves: list[tuple[int, int]]
    chunks: list[tuple[int, int, int, int | None, int]]


class RecurrentStates:
    """The state tensors of every Gated DeltaNet layer for ``slots`` sequences."""

    def __init__(self, shape: DeltaNetShape, linear: list[int], attention: list[int], slots: int,
                 conv_dtype: torch.dtype, device: torch.device, snapshots: int = 0) -> None:
        self.shape, self.slots, self.snapshots = shape, slots, snapshots
        # The native decode rows (``native.ops.DeltaNetDecode``) when the runner's CPU kernels apply.
        self.decode_kernel: Any = None
        self.index = {layer: i for i, layer in enumerate(linear)}
        self.kv_layers = {layer: i for i, layer in enumerate(attention)}
        n, rows = len(linear), slots + snapshots  # slot s is row s, saved state i row slots + i
        # torch.empty: on a CPU a row's pages are committed when it is first written.
        self.conv = torch.empty(n, rows, shape.conv_dim, shape.kernel - 1, dtype=conv_dtype, device=device)
        self.ssm = torch.empty(n, rows, shape.heads, shape.key_dim, shape.value_dim, dtype=torch.float32,
                               device=device)

    @staticmethod
    def bytes_per_slot(shape: DeltaNetShape, layers: int, conv_dtype: torch.dtype) -> int:
        """Bytes of one slot (or one saved state) over ``layers`` Gated DeltaNet layers."""
        return layers * shape.bytes_per_slot(conv_dtype)

    def step(self, batch: list[StepItem], first_row: list[int], num_decode: int) -> StateStep:
        """The batch's slots: those starting a sequence cleared, those resuming a saved state
        filled from it, and where each saves its state."""
        device = self.ssm.device
        bad = [it.seq_id for it in batch if not 0 <= it.state_slot < self.slots]
        bad += [it.seq_id for it in batch if it.state_restore >= self.snapshots or (
            it.state_snapshot is not None and not 0 <= it.state_snapshot[1] < self.snapshots)]
        if bad:
            raise ValueError(f"sequences {bad[:5]} name a state slot or saved state outside the "
                             f"{self.slots} + {self.snapshots} allocated")
        fresh = [it.state_slot for it in batch if it.start_pos == 0]
        if fresh:
            idx = torch.tensor(fresh, dtype=torch.long, device=device)
            self.conv.index_fill_(1, idx, 0)
            self.ssm.index_fill_(1, idx, 0)
        restore = [(self.slots + it.state_restore, it.state_slot) for it in batch if it.state_restore >= 0]
        if restore:
            src, dst = (torch.tensor(v, dtype=torch.long, device=device) for v in zip(*restore))
            self.conv.index_copy_(1, dst, self.conv.index_select(1, src))
            self.ssm.index_copy_(1, dst, self.ssm.index_select(1, src))
        decode = sorted((first_row[i], it.state_slot) for i, it in enumerate(batch) if first_row[i] < num_decode)
        saves: list[tuple[int, int]] = []
        chunks: list[tuple[int, int, int, int | None, int]] = []
        for i, it in enumerate(batch):
            cut, row = None, -1
            if it.state_snapshot is not None:
                cut, row = it.state_snapshot[0] - it.start_pos, self.slots + it.state_snapshot[1]
                if not 0 < cut <= len(it.token_ids):
                    end = it.start_pos + len(it.token_ids)
                    raise ValueError(f"sequence {it.seq_id}: a state saved after {it.state_snapshot[0]} tokens is "
                                     f"outside the fed positions {it.start_pos}..{end - 1}")
            if first_row[i] < num_decode:
                if cut is not None:
                    saves.append((it.state_slot, row))
            else:
                chunks.append((first_row[i], len(it.token_ids), it.state_slot, cut, row))
        slots = torch.tensor([s for _, s in decode], dtype=torch.long, device=device) if decode else None
        return StateStep(self, num_decode, slots, saves, chunks)


def _pieces(n: int, cut: int | None) -> list[tuple[int, int, bool]]:
    """A chunk of ``n`` tokens as (start, end, save after it) pieces, split where the state is saved."""
    if cut is None:
        return [(0, n, False)]
    return [(0, cut, True)] + ([(cut, n, False)] if cut < n else [])


def _project(module: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's input projections of ``x [T, hidden]``: the convolution's input ``[T, conv_dim]``
    (queries, keys, values), the output gate ``z [T, H, Dv]`` and ``b``, ``a [T, H]``."""
    if hasattr(module, "in_proj_qkvz"):  # Qwen3-Next: grouped per key head; its own method ungroups them
        q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(x)[None], module.in_proj_ba(x)[None])
        mixed = torch.cat([t.reshape(1, x.shape[0], -1) for t in (q, k, v)], -1)[0]
        return mixed, z[0], b[0], a[0]
    z = module.in_proj_z(x).view(x.shape[0], -1, module.head_v_dim)
    return module.in_proj_qkv(x), z, module.in_proj_b(x), module.in_proj_a(x)


@dataclass
class DeltaNetParams:
    """What one Gated DeltaNet layer computes with besides its projections: the convolution's
    weight ``[C, K]``, the decay's ``-exp(A_log)`` and ``dt_bias`` (float32, per value head), the
    gated norm's weight and epsilon, the head counts and sizes, and whether value heads take
    their key head in tiled order (``h % key_heads``, a GGUF file's) or grouped (``h // r``)."""

    layer: int                 # the layer's number in the model
    conv: torch.Tensor
    neg_a: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.Tensor
    eps: float
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    tiled: bool = False

    @classmethod
    def of(cls, module: Any) -> "DeltaNetParams":
        """From transformers' module (its weights stay where they are)."""
        return cls(layer=int(module.layer_idx), conv=module.conv1d.weight[:, 0, :],
                   neg_a=-module.A_log.detach().float().exp(), dt_bias=module.dt_bias.detach().float(),
                   norm=module.norm.weight, eps=float(module.norm.variance_epsilon),
                   key_heads=int(module.num_k_heads), value_heads=int(module.num_v_heads),
                   key_dim=int(module.head_k_dim), value_dim=int(module.head_v_dim))


def mix(p: DeltaNetParams, st: StateStep, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor,
        a: torch.Tensor) -> torch.Tensor:
    """A Gated DeltaNet layer's token mixing over a packed step, each sequence from and into its
    slot: ``mixed [T, C]`` (the convolution's input: queries, keys, values), the output gate
    ``z [T, H * Dv]`` and ``b``, ``a [T, H]`` -> the gated, normed output ``[T, H * Dv]`` (before
    the output projection), in ``mixed``'s dtype. Decode rows go through the native kernel when
    the runner set one (``RecurrentStates.decode_kernel``), the rest through torch."""
    kernel, nd = st.states.decode_kernel, st.num_decode if st.decode_slots is not None else 0
    if not nd or kernel is None or mixed.dtype != torch.float32:
        return _mix_torch(p, st, mixed, z, b, a, nd)
    layer = st.states.index[p.layer]
    conv, ssm = st.states.conv[layer], st.states.ssm[layer]
    out = torch.empty(mixed.shape[0], p.value_heads * p.value_dim, dtype=mixed.dtype, device=mixed.device)
    kernel(p, conv, ssm, st.decode_slots, mixed[:nd], z[:nd], b[:nd], a[:nd], out[:nd])
    for slot, row in st.decode_saves:
        conv[row].copy_(conv[slot])
        ssm[row].copy_(ssm[slot])
    if st.chunks:
        out[nd:] = _mix_torch(p, st, mixed[nd:], z[nd:], b[nd:], a[nd:], 0, shift=nd)
    return out


# Runs the prompt chunks of several sequences at once: (each one's rows, their states gathered
# [B, ...], updated in place) -> outputs [B, longest, ...].
Padded = Callable[[list[slice], torch.Tensor], torch.Tensor]


def _over_rows(st: StateStep, pool: torch.Tensor, slots: torch.Tensor | None, shift: int, out: torch.Tensor,
               step: Callable[[slice, torch.Tensor], torch.Tensor],
               chunk: Callable[[slice, torch.Tensor], torch.Tensor], padded: Padded | None = None) -> None:
    """One kind of state (a layer's ``pool``) through the step: the decode rows (when ``slots``)
    as one batch gathered from the pool and written back, ``step(rows, batch)``; each prompt
    chunk on its slot in place, ``chunk(rows, state)``, split where its state is saved, or (given
    ``padded`` and several chunks) all at once; results into ``out``'s rows (chunks' first rows
    ``shift`` further on in the step)."""
    if slots is not None:
        nd = slots.shape[0]
        batch = pool.index_select(0, slots)
        out[:nd] = step(slice(0, nd), batch)
        pool.index_copy_(0, slots, batch)
        for slot, row in st.decode_saves:
            pool[row].copy_(pool[slot])
    if padded is not None and len(st.chunks) > 1:
        _padded_chunks(st, pool, shift, out, padded)
        return
    for first, n, slot, cut, saved in st.chunks:
        first -= shift
        for lo, hi, save in _pieces(n, cut):
            out[first + lo:first + hi] = chunk(slice(first + lo, first + hi), pool[slot])
            if save:
                pool[saved].copy_(pool[slot])


def _padded_chunks(st: StateStep, pool: torch.Tensor, shift: int, out: torch.Tensor, padded: Padded) -> None:
    """Every prompt chunk of the step in one ``padded`` call (two where some state is saved inside
    a chunk: the pieces up to the saves, the saves, then the rest)."""
    before: list[tuple[int, int, int, int]] = []  # (first row, length, slot, row saved after it or -1)
    after: list[tuple[int, int, int, int]] = []
    for first, n, slot, cut, saved in st.chunks:
        first -= shift
        before.append((first, n if cut is None else cut, slot, -1 if cut is None else saved))
        if cut is not None and cut < n:
            after.append((first + cut, n - cut, slot, -1))
    for phase in (before, after):
        if not phase:
            continue
        idx = torch.tensor([slot for _, _, slot, _ in phase], dtype=torch.long, device=pool.device)
        states = pool.index_select(0, idx)
        result = padded([slice(a, a + n) for a, n, _, _ in phase], states)
        for i, (a, n, _, _) in enumerate(phase):
            out[a:a + n] = result[i, :n]
        pool.index_copy_(0, idx, states)
        for _, _, slot, saved in phase:
            if saved >= 0:
                pool[saved].copy_(pool[slot])


def _conv_padded(x: torch.Tensor, weight: torch.Tensor) -> Padded:
    """Several sequences' prompt chunks of ``x [T, C]`` through the short convolution at once."""
    def run(rows: list[slice], windows: torch.Tensor) -> torch.Tensor:
        lengths = [r.stop - r.start for r in rows]
        return deltanet.conv_chunks(_stacked(rows, x[:, None]).transpose(0, 1), lengths, weight, windows)
    return run


def _stacked(rows: list[slice], x: torch.Tensor) -> torch.Tensor:
    """The rows ``rows[i]`` of ``x [T, H, ...]`` as ``[longest, B * H, ...]`` (sequence-major within
    a row), zero past each one's end."""
    longest = max(r.stop - r.start for r in rows)
    buf = x.new_zeros((longest, len(rows)) + tuple(x.shape[1:]))
    for i, r in enumerate(rows):
        buf[:r.stop - r.start, i] = x[r]
    return buf.flatten(1, 2)


def _delta_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> Padded:
    """Several sequences' prompt chunks through one chunked delta rule, their heads side by side
    (positions past a sequence's end have k = v = g = beta = 0: they decay and write nothing)."""
    def run(rows: list[slice], states: torch.Tensor) -> torch.Tensor:
        B, H = len(rows), q.shape[1]
        o = deltanet.chunked(*(_stacked(rows, t) for t in (q, k, v, g, beta)), states.view(B * H, *states.shape[2:]))
        return o.view(o.shape[0], B, H, -1).transpose(0, 1)
    return run


def _mix_torch(p: DeltaNetParams, st: StateStep, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor,
               a: torch.Tensor, nd: int, shift: int = 0) -> torch.Tensor:
    """``mix`` in torch over these rows: the first ``nd`` the decode rows (0: none here), then the
    step's prompt chunks, whose first rows are ``shift`` further on in the step."""
    layer = st.states.index[p.layer]
    slots = st.decode_slots if nd else None
    conv_out = torch.empty_like(mixed)
    _over_rows(st, st.states.conv[layer], slots, shift, conv_out,
               lambda rows, window: deltanet.conv_step(mixed[rows], p.conv, window),
               lambda rows, window: deltanet.conv_chunk(mixed[rows], p.conv, window), _conv_padded(mixed, p.conv))
    conv_out = F.silu(conv_out)
    kd, T = p.key_heads * p.key_dim, mixed.shape[0]
    q = conv_out[:, :kd].reshape(T, p.key_heads, p.key_dim)
    k = conv_out[:, kd:2 * kd].reshape(T, p.key_heads, p.key_dim)
    v = conv_out[:, 2 * kd:].reshape(T, p.value_heads, p.value_dim)
    beta = b.float().sigmoid()
    g = p.neg_a * F.softplus(a.float() + p.dt_bias)
    q, k = deltanet.prepare(q, k, p.value_heads, p.tiled)
    out = torch.empty(T, p.value_heads, p.value_dim, dtype=torch.float32, device=mixed.device)
    _over_rows(st, st.states.ssm[layer], slots, shift, out,
               lambda rows, state: deltanet.step(q[rows], k[rows], v[rows], g[rows], beta[rows], state),
               lambda rows, state: deltanet.chunked(q[rows], k[rows], v[rows], g[rows], beta[rows], state),
               _delta_padded(q, k, v, g, beta))
    return deltanet.gated_norm(out.to(mixed.dtype), z.reshape(T, p.value_heads, p.value_dim), p.norm,
                               p.eps).view(T, -1)


def _forward(module: Any, params: DeltaNetParams, hidden_states: torch.Tensor, *args: Any,
             **kwargs: Any) -> torch.Tensor:
    """transformers' Gated DeltaNet layer over a packed step ``[1, T, hidden]``."""
    _, meta = current_step()
    x = hidden_states[0]
    mixed, z, b, a = _project(module, x)
    return module.out_proj(mix(params, meta.states, mixed, z.reshape(x.shape[0], -1), b, a))[None]


@dataclass(frozen=True)
class ShortConvParams:
    """One short-convolution layer's depthwise causal convolution: ``weight [C, K]`` and its bias."""

    layer: int
    weight: torch.Tensor
    bias: torch.Tensor | None

    @classmethod
    def of(cls, module: Any) -> "ShortConvParams":
        """From transformers' module (LFM2's ``conv``; its weights stay where they are)."""
        return cls(layer=int(module.layer_idx), weight=module.conv.weight[:, 0, :], bias=module.conv.bias)


def short_conv(p: ShortConvParams, st: StateStep, bx: torch.Tensor) -> torch.Tensor:
    """The convolution of ``bx [T, C]`` over a packed step, each sequence from and into its slot's
    window (decode rows batched, prompt chunks in place), plus the bias."""
    out = torch.empty_like(bx)
    slots = st.decode_slots if st.num_decode else None
    _over_rows(st, st.states.conv[st.states.index[p.layer]], slots, 0, out,
               lambda rows, window: deltanet.conv_step(bx[rows], p.weight, window),
               lambda rows, window: deltanet.conv_chunk(bx[rows], p.weight, window), _conv_padded(bx, p.weight))
    return out if p.bias is None else out.add_(p.bias)


def _short_conv_forward(module: Any, params: ShortConvParams, hidden_states: torch.Tensor, *args: Any,
                        **kwargs: Any) -> torch.Tensor:
    """LFM2's short-convolution layer over a packed step ``[1, T, hidden]``: ``B * x`` through the
    depthwise causal convolution from each sequence's window, times ``C``."""
    _, meta = current_step()
    gate_in, gate_out, x = module.in_proj(hidden_states[0]).chunk(3, dim=-1)
    return module.out_proj(gate_out * short_conv(params, meta.states, gate_in * x))[None]


def _mamba_padded(xs: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> Padded:
    """Several sequences' prompt chunks through one chunked Mamba2 recurrence, their heads side by
    side (positions past a sequence's end have dt = 0: they decay and write nothing)."""
    def run(rows: list[slice], states: torch.Tensor) -> torch.Tensor:
        n, H = len(rows), xs.shape[1]
        o = mamba2.chunked(*(_stacked(rows, t) for t in (xs, dt)), a.repeat(n), *(_stacked(rows, t) for t in (b, c)),
                           states.view(n * H, *states.shape[2:]))
        return o.view(o.shape[0], n, H, -1).transpose(0, 1)
    return run


def _mamba_forward(module: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """A Mamba2 layer over a packed step ``[1, T, hidden]``: its convolution and selective state
    from each sequence's slot (``mamba2``), the ``D`` skip, the gated group norm, the output
    projection."""
    _, meta = current_step()
    st: StateStep = meta.states
    x = hidden_states[0]
    T, H, P, N, G = x.shape[0], module.num_heads, module.head_dim, module.ssm_state_size, module.n_groups
    gate, xbc, dt = module.in_proj(x).split([module.intermediate_size, module.conv_dim, H], dim=-1)
    layer, weight = st.states.index[module.layer_idx], module.conv1d.weight[:, 0, :]
    slots = st.decode_slots if st.num_decode else None
    conv = torch.empty_like(xbc)
    _over_rows(st, st.states.conv[layer], slots, 0, conv,
               lambda rows, window: deltanet.conv_step(xbc[rows], weight, window),
               lambda rows, window: deltanet.conv_chunk(xbc[rows], weight, window), _conv_padded(xbc, weight))
    conv = module.act(conv if module.conv1d.bias is None else conv + module.conv1d.bias)
    xs, b, c = conv.split([H * P, G * N, G * N], dim=-1)
    xs = xs.reshape(T, H, P)
    b, c = (mamba2.groups_to_heads(t.reshape(T, G, N), H) for t in (b, c))
    dt = F.softplus(dt.float() + module.dt_bias.float())
    low, high = module.time_step_limit
    if low > 0.0 or high < float("inf"):
        dt = dt.clamp(low, high)
    a = -module.A_log.float().exp()
    y = torch.empty(T, H, P, dtype=torch.float32, device=x.device)
    _over_rows(st, st.states.ssm[layer], slots, 0, y,
               lambda rows, state: mamba2.step(xs[rows], dt[rows], a, b[rows], c[rows], state),
               lambda rows, state: mamba2.chunked(xs[rows], dt[rows], a, b[rows], c[rows], state),
               _mamba_padded(xs, dt, a, b, c))
    y = y + module.D.float()[:, None] * xs.float()
    return module.out_proj(module.norm(y.reshape(T, H * P).to(x.dtype), gate).to(x.dtype))[None]


def install(model: Any) -> None:
    """Run every recurrent layer of ``model`` (Gated DeltaNet, short convolution, Mamba2) over the
    step's slots instead of through its own forward (one sequence, its state in transformers' cache)."""
    for _, module in _deltanet_layers(model):
        module.forward = partial(_forward, module, DeltaNetParams.of(module))
    for _, module in _short_conv_layers(model):
        module.forward = partial(_short_conv_forward, module, ShortConvParams.of(module))
    for _, module in _mamba_layers(model):
        module.forward = partial(_mamba_forward, module)
