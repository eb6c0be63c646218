"""The Mamba2 selective state-space recurrence (Granite 4.0-H's Mamba layers) over one sequence's
tokens from a given state: the chunked form for prompt chunks, the step form for decode rows of
many sequences at once. Its short causal convolution is ``deltanet.conv_step`` / ``conv_chunk``.

Per head the state ``S`` is a ``[P, N]`` matrix (head size by state size). Each token decays it
by ``exp(dt * A)`` (``dt``: the token's softplus step size for the head, ``A < 0``), writes
``dt * x B^T`` and reads ``y = S C + D x``; ``B`` and ``C`` (``[N]`` per group of heads) come from
the convolution, like ``x``.

The chunked form gets the same numbers with matrix products: inside a chunk, with ``gamma`` the
decay ``dt * A`` summed from the chunk's start, ``y_i = exp(gamma_i) C_i S0 + sum_{j <= i}
exp(gamma_i - gamma_j) (C_i . B_j) dt_j x_j`` and the state at the chunk's end
``exp(gamma_C) S0 + sum_j exp(gamma_C - gamma_j) dt_j x_j B_j^T``. Everything runs in float32.
"""

from __future__ import annotations

import torch

CHUNK = 64  # tokens per chunk of the chunked form


def step(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
         state: torch.Tensor) -> torch.Tensor:
    """One token of each of B sequences: ``x [B, H, P]``, ``dt [B, H]`` (after softplus), ``a [H]``
    (negative), ``b``, ``c [B, H, N]`` (each head's group's); ``state [B, H, P, N]`` (float32)
    updated in place. Returns ``S C`` ``[B, H, P]`` (without the ``D x`` skip)."""
    state.mul_((dt * a).exp()[..., None, None])
    state.add_((dt[..., None] * x.float())[..., :, None] * b.float()[..., None, :])
    return torch.einsum("bhpn,bhn->bhp", state, c.float())


def chunked(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
            state: torch.Tensor) -> torch.Tensor:
    """``n`` tokens of one sequence: ``x [n, H, P]``, ``dt [n, H]``, ``a [H]``, ``b``, ``c [n, H, N]``;
    ``state [H, P, N]`` (float32, the state before them) updated in place to the state after them.
    Returns ``S C`` ``[n, H, P]``."""
    x, b, c = x.float(), b.float(), c.float()
    out = torch.empty_like(x)
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=x.device).tril()
    for lo in range(0, x.shape[0], CHUNK):
        hi = min(lo + CHUNK, x.shape[0])
        xs, ds, bs, cs = x[lo:hi], dt[lo:hi], b[lo:hi], c[lo:hi]
        gamma = (ds * a).cumsum(0)                                        # [l, H]
        diff = gamma[:, None, :] - gamma[None, :, :]                       # gamma_i - gamma_j: [i, j, H]
        n = hi - lo
        decay = torch.where(causal[:n, :n, None], diff, float("-inf")).exp()
        weights = torch.einsum("ihn,jhn->ijh", cs, bs) * decay * ds[None]  # [i, j, H]
        out[lo:hi] = torch.einsum("ijh,jhp->ihp", weights, xs) + torch.einsum(
            "ihn,hpn->ihp", cs * gamma.exp()[..., None], state)
        to_end = (gamma[-1][None] - gamma).exp() * ds                    # [j, H]
        state.mul_(gamma[-1].exp()[:, None, None]).add_(torch.einsum("jh,jhp,jhn->hpn", to_end, xs, bs))
    return out


def groups_to_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[..., G, N]`` -> ``[..., H, N]``: head ``h`` takes group ``h // (H / G)``."""
    return x.repeat_interleave(heads // x.shape[-2], dim=-2) if x.shape[-2] != heads else x
