"""The mixture-of-experts feed-forward of the fused forward (Qwen3-MoE, Mixtral, gpt-oss,
Qwen3.5-MoE): a router picks each row's top-k experts as the model defines it (softmax in fp32 over every
expert, the top k, renormalised to sum to one where the model says so; or gpt-oss's top k of
the logits, then a softmax over those k), the step's rows are grouped by expert with one sort,
and each expert that any row picked runs one gate-and-up and one down product over its rows
only; the results are scaled by the routing weights and summed into the rows in ascending
expert order, as transformers' loop sums them. Qwen3.5-MoE and Qwen3-Next add a shared expert
every row runs, scaled by a sigmoid gate of its own (``SharedExpert``).

The experts' weights are whatever linears the caller gives: the model's own 3-D tensors sliced
per expert (views, or packed for the native kernel), or a GGUF file's blocks per expert, which
stay in the memory-mapped file, so an expert no token picks never becomes resident.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

Linear = Callable[[torch.Tensor], torch.Tensor]


class SharedExpert:
    """The expert every row runs beside the routed ones: ``sigmoid(gate(x)) * down(act(gate_up(x)))``
    (``gate``: hidden -> one logit a row)."""

    __slots__ = ("gate_up", "down", "gate", "act")

    def __init__(self, gate_up: Linear, down: Linear, gate: Linear, act: Callable[[torch.Tensor], torch.Tensor]):
        self.gate_up, self.down, self.gate, self.act = gate_up, down, gate, act

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate_up(x))).mul_(torch.sigmoid(self.gate(x)))


class MoEFeedForward:
    """``x [T, hidden] -> [T, hidden]``: the routed experts' outputs, weighted and summed (plus
    the shared expert's, where the model has one)."""

    def __init__(self, router: Linear, gate_up: list[Linear], down: list[Linear], top_k: int, normalize: bool,
                 act: Callable[[torch.Tensor], torch.Tensor], softmax_first: bool = True,
                 shared: SharedExpert | None = None, expert_scale: torch.Tensor | None = None) -> None:
        """``router``: hidden -> one logit per expert; ``gate_up[e]``: hidden -> [gate | up] of
        expert e; ``down[e]``: its intermediate -> hidden; ``act``: the gated activation of a
        ``[T, 2 * I]`` gate-and-up tensor (``silu_mul``); ``softmax_first``: softmax over every
        expert, then the top k (renormalised when ``normalize``), else the top k logits and a
        softmax over them (gpt-oss); ``shared``: the shared expert, added to every row;
        ``expert_scale``: a learned factor per expert on its routing weight (Gemma 4, fp32 ``[E]``)."""
        if len(gate_up) != len(down) or not 0 < top_k <= len(gate_up):
            raise ValueError(f"{len(gate_up)} experts' gate-and-up, {len(down)} down projections and top {top_k}")
        self.router, self.gate_up, self.down = router, gate_up, down
        self.top_k, self.normalize, self.act, self.softmax_first = top_k, normalize, act, softmax_first
        self.shared, self.expert_scale = shared, expert_scale
        self.num_experts = len(gate_up)
        # How many rows each expert has served since load (the router's choices; tests and the
        # memory check read it).
        self.hits = torch.zeros(self.num_experts, dtype=torch.int64)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's experts ``[T, k]`` and their weights ``[T, k]`` (in ``x``'s dtype)."""
        logits = self.router(x)
        if not self.softmax_first:  # gpt-oss: its router's order and dtype
            top, experts = torch.topk(logits, self.top_k, dim=-1)
            return experts, torch.softmax(top, dim=-1).to(x.dtype)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        if self.expert_scale is not None:
            weights = weights * self.expert_scale[experts]
        return experts, weights.to(x.dtype)

    def __call__(self, x: torch.Tensor, route: torch.Tensor | None = None) -> torch.Tensor:
        """The experts over ``x``, routed by ``route`` (Gemma 4 routes the residual stream and feeds
        the experts its own norm of it) or, when None, by ``x`` itself."""
        experts, weights = self.route(x if route is None else route)
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
        return out if self.shared is None else out.add_(self.shared(x))

    def linears(self) -> list[Linear]:
        """Every product: the router, each expert's two, the shared expert's three."""
        shared = self.shared
        return [self.router, *self.gate_up, *self.down,
                *((shared.gate_up, shared.down, shared.gate) if shared is not None else ())]


def clamped_swiglu(gu: torch.Tensor, alpha: float, limit: float, interleaved: bool) -> torch.Tensor:
    """gpt-oss's expert activation of a ``[T, 2 * I]`` gate-and-up tensor -> ``[T, I]``: the gate
    clamped from above and the up part to ``[-limit, limit]``, ``(up + 1) * gate * sigmoid(alpha *
    gate)``, in transformers' order of operations. ``interleaved``: gate and up alternate along
    the row (the checkpoint's layout); else the gate is the first half (llama.cpp's files)."""
    inter = gu.shape[-1] // 2
    gate, up = (gu[:, 0::2], gu[:, 1::2]) if interleaved else (gu[:, :inter], gu[:, inter:])
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@dataclass(frozen=True)
class SparseParts:
    """A transformers sparse-MoE block the fused forward runs, and how its parts are laid out."""

    router: Any                 # the routing module: ``weight [E, hidden]`` (and ``bias`` where ``biases``)
    experts: Any                # 3-D ``gate_up_proj`` and ``down_proj`` (and their ``_bias``)
    top_k: int
    softmax_first: bool         # softmax over every expert, then the top k (else gpt-oss's top k, then softmax)
    normalize: bool             # the top-k weights renormalised (softmax-first routers)
    transposed: bool            # matrices stored input-major: gate_up ``[E, hidden, 2I]``, down ``[E, I, hidden]``
    biases: bool                # router and experts carry biases
    clamp: tuple[float, float] | None  # gpt-oss's clamped SwiGLU (alpha, limit), its gate and up interleaved
    shared: Any = None          # the shared expert (``gate_proj``, ``up_proj``, ``down_proj``), where there is one
    shared_gate: Any = None     # its gate: a bias-free linear, hidden -> 1

    def gate_up_weight(self, e: int) -> torch.Tensor:
        """Expert ``e``'s gate-and-up matrix as ``[2I, hidden]`` (a view)."""
        w = self.experts.gate_up_proj[e]
        return w.t() if self.transposed else w

    def down_weight(self, e: int) -> torch.Tensor:
        """Expert ``e``'s down matrix as ``[hidden, I]`` (a view)."""
        w = self.experts.down_proj[e]
        return w.t() if self.transposed else w

    def bias(self, name: str, e: int) -> torch.Tensor | None:
        return getattr(self.experts, f"{name}_bias")[e] if self.biases else None


def _is_3d(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 3


def moe_parts(mlp: Any) -> SparseParts | None:
    """The parts of a transformers sparse-MoE block whose experts are 3-D tensors and whose
    router is one of the two known kinds: a bias-free linear with a softmax over every expert
    then the top k (Qwen3-MoE, Mixtral, OLMoE: ``gate`` + ``experts``, gate and up as halves;
    Qwen3.5-MoE and Qwen3-Next add ``shared_expert`` and its ``shared_expert_gate``), or gpt-oss's
    biased linear with the top k then a softmax (``router`` + ``experts``, biased experts stored
    input-major, gate and up interleaved, a clamped SwiGLU); None for any other feed-forward."""
    children = {n for n, _ in mlp.named_children()}
    experts = getattr(mlp, "experts", None)
    if experts is None or not (_is_3d(getattr(experts, "gate_up_proj", None))
                               and _is_3d(getattr(experts, "down_proj", None))):
        return None
    if children in ({"gate", "experts"}, _SHARED_CHILDREN):
        router = mlp.gate
        if not (hasattr(router, "weight") and hasattr(router, "top_k") and getattr(router, "bias", None) is None):
            return None
        if any(hasattr(experts, b) for b in ("gate_up_proj_bias", "down_proj_bias")):
            return None
        if getattr(experts, "is_transposed", False) or not getattr(experts, "is_concatenated", True):
            return None
        shared = _shared(mlp) if children == _SHARED_CHILDREN else None
        if children == _SHARED_CHILDREN and shared is None:
            return None
        return SparseParts(router, experts, int(router.top_k), True, normalizes(router), False, False, None,
                           *(shared or (None, None)))
    if children == {"router", "experts"} and type(experts).__name__ == "GptOssExperts":
        router = mlp.router
        if not (type(router).__name__ == "GptOssTopKRouter" and getattr(router, "bias", None) is not None
                and all(isinstance(b := getattr(experts, name, None), torch.Tensor) and b.dim() == 2
                        for name in ("gate_up_proj_bias", "down_proj_bias"))
                and getattr(experts, "is_transposed", False) and not getattr(experts, "is_concatenated", True)):
            return None
        return SparseParts(router, experts, int(router.top_k), False, False, True, True,
                           (float(experts.alpha), float(experts.limit)))
    return None


_SHARED_CHILDREN = {"gate", "experts", "shared_expert", "shared_expert_gate"}


def _shared(mlp: Any) -> tuple[Any, Any] | None:
    """The shared expert and its gate: a gated MLP of bias-free linears, and a bias-free linear
    to one logit; None for anything else."""
    expert, gate = mlp.shared_expert, mlp.shared_expert_gate
    parts = [getattr(expert, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if {n for n, _ in expert.named_children()} != {"gate_proj", "up_proj", "down_proj", "act_fn"}:
        return None
    if not all(isinstance(p, torch.nn.Linear) and p.bias is None for p in [*parts, gate]):
        return None
    return (expert, gate) if tuple(gate.weight.shape)[0] == 1 else None


def normalizes(router: Any) -> bool:
    """Whether the router renormalises its top-k weights (Mixtral always; Qwen3-MoE and OLMoE
    by ``norm_topk_prob``)."""
    return bool(getattr(router, "norm_topk_prob", True))
