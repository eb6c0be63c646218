"""The gated delta rule (Gated DeltaNet linear attention, Qwen3.5 / Qwen3-Next) and its short causal
convolution, over one sequence's tokens from a given state: the chunked form for prompt chunks,
the step form for decode rows of many sequences at once.

Per value head the state ``S`` is a ``[Dk, Dv]`` matrix. Each token first decays it by
``exp(g)``, then writes the part of its value the state does not already predict:
``S += beta * k (v - S^T k)^T``, and reads ``o = S^T q``. Queries and keys are L2-normalised
and the queries scaled by ``Dk ** -0.5`` before any of that (``prepare``).

The chunked form (``chunked``) gets the same numbers with matrix products: inside a chunk of
``CHUNK`` tokens the writes ``U`` solve ``(I + A) U = beta V - beta exp(gamma) K S0`` with
``A[i, j] = beta_i exp(gamma_i - gamma_j) k_i . k_j`` for ``j < i`` (``gamma``: the decay summed
from the chunk's start), a unit lower-triangular system; the outputs are
``exp(gamma) Q S0 + (exp(gamma_i - gamma_j) q_i . k_j)_{j <= i} U`` and the state at the chunk's
end ``exp(gamma_C) S0 + (exp(gamma_C - gamma) K)^T U``. Everything runs in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64          # tokens per chunk of the chunked form
STEP_BELOW = 8      # prompt chunks shorter than this run the step form token by token


def prepare(q: torch.Tensor, k: torch.Tensor, v_heads: int, tiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``q``, ``k [..., Hk, Dk]`` in float32, L2-normalised (the query also scaled by ``Dk ** -0.5``)
    and repeated so that each of the ``v_heads`` value heads has its own: key head ``h`` serves value
    heads ``h * r .. h * r + r - 1`` (grouped, as checkpoints order them) or, ``tiled`` (as llama.cpp's
    converter reorders them), value heads ``h, h + Hk, h + 2 Hk, ...``."""
    q, k = normalize(q, k)
    return expand(q, v_heads, tiled), expand(k, v_heads, tiled)


def normalize(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``q``, ``k`` in float32, L2-normalised, the query also scaled by ``Dk ** -0.5``."""
    q, k = q.float(), k.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return q, k


def expand(x: torch.Tensor, v_heads: int, tiled: bool) -> torch.Tensor:
    """Key heads ``[..., Hk, Dk]`` repeated to one per value head (``prepare``'s orders)."""
    r = v_heads // x.shape[-2]
    if r == 1:
        return x
    return x.repeat((1,) * (x.dim() - 2) + (r, 1)) if tiled else x.repeat_interleave(r, dim=-2)


def gated_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head's output ``x [T, H, Dv]`` (normalised in float32, cast back, scaled by
    ``weight``) times ``silu(gate)`` (in float32), in ``x``'s dtype."""
    y = x.float()
    y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * y * F.silu(gate.float())).to(x.dtype)


def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
         state: torch.Tensor) -> torch.Tensor:
    """One token of each of B sequences: ``q``, ``k [B, H, Dk]`` (prepared), ``v [B, H, Dv]``,
    ``g``, ``beta [B, H]``; ``state [B, H, Dk, Dv]`` (float32) updated in place. Returns ``[B, H, Dv]``."""
    state.mul_(g.exp()[..., None, None])
    predicted = torch.einsum("bhkv,bhk->bhv", state, k)
    write = (v.float() - predicted) * beta[..., None]
    state.add_(k[..., :, None] * write[..., None, :])
    return torch.einsum("bhkv,bhk->bhv", state, q)


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor) -> torch.Tensor:
    """``n`` tokens of one sequence: ``q``, ``k [n, H, Dk]`` (prepared), ``v [n, H, Dv]``, ``g``,
    ``beta [n, H]``; ``state [H, Dk, Dv]`` (float32, the state before them) updated in place to the
    state after them. Returns ``[n, H, Dv]``."""
    n = q.shape[0]
    if n < STEP_BELOW:
        s = state[None]
        out = [step(q[t][None], k[t][None], v[t][None], g[t][None], beta[t][None], s)[0] for t in range(n)]
        return torch.stack(out)
    # A prompt shorter than a chunk takes the next power of two instead: the same numbers, with
    # products and a solve a fraction of the size (a conversation's short turns, a batch of prompts).
    size = CHUNK if n >= CHUNK else 1 << (n - 1).bit_length()
    pad = -n % size

    # [H, chunks, size, D]: padded positions have k = v = beta = g = 0, so they write nothing
    # and decay nothing (their outputs are dropped).
    def chunks(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if pad:
            x = F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad))
        return x.transpose(0, 1).reshape(x.shape[1], -1, size, *x.shape[2:])

    qc, kc, vc, gc, bc = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    gamma = gc.cumsum(-1)                                                # [H, N, C]
    diff = gamma[..., :, None] - gamma[..., None, :]                     # gamma_i - gamma_j
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(causal, diff, float("-inf")).exp()               # exp(gamma_i - gamma_j), j <= i
    strict = decay.tril(-1)
    a = (kc @ kc.transpose(-1, -2)) * strict * bc[..., None]             # A, strictly lower
    eye = torch.eye(size, dtype=a.dtype, device=a.device)
    lhs = a + eye
    # One solve for both right-hand sides (values and decayed keys side by side).
    dv = vc.shape[-1]
    both = torch.linalg.solve_triangular(lhs, torch.cat((vc * bc[..., None], kc * (bc * gamma.exp())[..., None]), -1),
                                         upper=False, unitriangular=True)
    wv, wk = both[..., :dv], both[..., dv:]
    attn = (qc @ kc.transpose(-1, -2)) * decay                           # [H, N, C, C]
    q_decayed = qc * gamma.exp()[..., None]
    k_to_end = kc * (gamma[..., -1:] - gamma).exp()[..., None]
    end_decay = gamma[..., -1].exp()                                      # [H, N]
    out = torch.empty_like(vc)
    for c in range(qc.shape[1]):
        u = wv[:, c] - wk[:, c] @ state                                   # [H, C, Dv]
        out[:, c] = q_decayed[:, c] @ state + attn[:, c] @ u
        state.mul_(end_decay[:, c, None, None]).add_(k_to_end[:, c].transpose(-1, -2) @ u)
    return out.reshape(out.shape[0], -1, out.shape[-1])[:, :n].transpose(0, 1)


def conv_step(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """The causal depthwise convolution for one new input of each of B sequences: ``x [B, C]``,
    ``weight [C, K]``, ``window [B, C, K - 1]`` (the previous inputs, oldest first) shifted in
    place to end with ``x``. Returns the convolution's output ``[B, C]`` (before the activation)."""
    full = torch.cat((window, x[..., None].to(window.dtype)), -1)        # [B, C, K]
    window.copy_(full[..., 1:])
    return (full.to(weight.dtype) * weight).sum(-1)


def conv_chunks(xs: torch.Tensor, lengths: list[int], weight: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
    """``conv_chunk`` for B sequences at once: ``xs [B, n, C]`` (each one's first ``lengths[b]``
    inputs; the rest padding), ``windows [B, C, K - 1]`` updated in place to each one's last K - 1
    real inputs. Returns ``[B, n, C]`` (rows past a sequence's length are not meaningful)."""
    n, K = xs.shape[1], weight.shape[1]
    full = torch.cat((windows.to(xs.dtype), xs.transpose(1, 2)), -1).to(weight.dtype)  # [B, C, K - 1 + n]
    for b, length in enumerate(lengths):
        windows[b].copy_(full[b, :, length:length + K - 1])
    out = full[..., K - 1:] * weight[:, K - 1:]
    for j in range(K - 1):
        out.addcmul_(full[..., j:j + n], weight[:, j:j + 1])
    return out.transpose(1, 2)


def conv_chunk(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """The same over ``n`` inputs of one sequence: ``x [n, C]``, ``window [C, K - 1]`` (updated in
    place to the last K - 1 inputs). Returns ``[n, C]``."""
    full = torch.cat((window.to(x.dtype), x.t()), -1).to(weight.dtype)  # [C, K - 1 + n]
    window.copy_(full[:, full.shape[1] - window.shape[-1]:])
    # A depthwise convolution as K shifted multiply-adds: torch's grouped conv1d is several times slower.
    n, K = x.shape[0], weight.shape[1]
    out = full[:, K - 1:] * weight[:, K - 1:]
    for j in range(K - 1):
        out.addcmul_(full[:, j:j + n], weight[:, j:j + 1])
    return out.t()
