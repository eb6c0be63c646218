"""The mixture-of-experts feed-forward of the fused forward (Qwen3-MoE, Mixtral): a router picks
each row's top-k experts as the model defines it (softmax in fp32 over every expert, the top k,
renormalised to sum to one where the model says so), the step's rows are grouped by expert with
one sort, and each expert that any row picked runs one gate-and-up and one down product over
its rows only; the results are scaled by the routing weights and summed into the rows in
ascending expert order, as transformers' loop sums them.

The experts' weights are whatever linears the caller gives: the model's own 3-D tensors sliced
per expert (views, or packed for the native kernel), or a GGUF file's blocks per expert, which
stay in the memory-mapped file, so an expert no token picks never becomes resident.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

Linear = Callable[[torch.Tensor], torch.Tensor]


class MoEFeedForward:
    """``x [T, hidden] -> [T, hidden]``: the routed experts' outputs, weighted and summed."""

    def __init__(self, router: Linear, gate_up: list[Linear], down: list[Linear], top_k: int, normalize: bool,
                 act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """``router``: hidden -> one logit per expert; ``gate_up[e]``: hidden -> [gate | up] of
        expert e; ``down[e]``: its intermediate -> hidden; ``act``: the gated activation of a
        ``[T, 2 * I]`` gate-and-up tensor (``silu_mul``)."""
        if len(gate_up) != len(down) or not 0 < top_k <= len(gate_up):
            raise ValueError(f"{len(gate_up)} experts' gate-and-up, {len(down)} down projections and top {top_k}")
        self.router, self.gate_up, self.down = router, gate_up, down
        self.top_k, self.normalize, self.act = top_k, normalize, act
        self.num_experts = len(gate_up)
        # How many rows each expert has served since load (the router's choices; tests and the
        # memory check read it).
        self.hits = torch.zeros(self.num_experts, dtype=torch.int64)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's experts ``[T, k]`` and their weights ``[T, k]`` (in ``x``'s dtype)."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        out = torch.zeros_like(x)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)   # the (row, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts)
        self.hits += counts.cpu()
        rows, slots = order // self.top_k, order % self.top_k
        start = 0
        for e, n in enumerate(counts.tolist()):
            if not n:
                continue
            r, s = rows[start:start + n], slots[start:start + n]
            start += n
            y = self.down[e](self.act(self.gate_up[e](x.index_select(0, r).contiguous())))
            out.index_add_(0, r, y.mul_(weights[r, s].unsqueeze(1)))
        return out


def moe_parts(mlp: Any) -> tuple[Any, Any] | None:
    """``(router, experts)`` of a transformers sparse-MoE block whose experts are 3-D tensors
    (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, no biases) and whose router is a
    top-k softmax over a bias-free linear; None for any other feed-forward."""
    children = {n for n, _ in mlp.named_children()}
    if children != {"gate", "experts"}:
        return None
    router, experts = mlp.gate, mlp.experts
    if not (hasattr(router, "weight") and hasattr(router, "top_k") and getattr(router, "bias", None) is None):
        return None
    gu, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3 and down.dim() == 3):
        return None
    if any(hasattr(experts, b) for b in ("gate_up_proj_bias", "down_proj_bias")):
        return None
    return router, experts


def normalizes(router: Any) -> bool:
    """Whether the router renormalises its top-k weights (Mixtral always; Qwen3-MoE and OLMoE
    by ``norm_topk_prob``)."""
    return bool(getattr(router, "norm_topk_prob", True))
