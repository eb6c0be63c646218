"""Which decoder layers keep keys and values in the paged cache, and of what shape: one pool layer
per layer by default; Gemma 4's global layers keep fewer, wider heads than its sliding ones, and
its last layers keep none of their own (they read the keys and values of the last earlier layer
of their kind, transformers' ``kv_sharing_modes``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KVLayout:
    """``shapes``: per pool layer ``(kv_heads, head_dim)``; ``layer_of``: model layer -> pool
    layer (None: the same number); ``shared``: the model layers that read another layer's pool
    layer and write none."""

    shapes: list[tuple[int, int]]
    layer_of: dict[int, int] | None = None
    shared: frozenset[int] = frozenset()

    @property
    def uniform(self) -> bool:
        return len(set(self.shapes)) <= 1


def _shapes(cfg: Any) -> list[tuple[int, int]]:
    """Every layer's ``(kv_heads, head_dim)``, from its own config where transformers keeps
    per-layer overrides (a heterogeneous config refuses reading them globally)."""
    layers = int(cfg.num_hidden_layers)
    own = cfg.per_layer_config if getattr(cfg, "is_heterogeneous", False) else [cfg] * layers
    out = []
    for c in own:
        heads = int(c.num_attention_heads)
        out.append((int(getattr(c, "num_key_value_heads", None) or heads),
                    int(getattr(c, "head_dim", None) or c.hidden_size // heads)))
    return out


def _sharing(cfg: Any) -> list[str | None]:
    """Per layer ``None``/``"store"`` (keeps its own keys and values) or ``"reuse"`` (reads another's)."""
    if not int(getattr(cfg, "num_kv_shared_layers", 0) or 0):
        return [None] * int(cfg.num_hidden_layers)
    return list(cfg.kv_sharing_modes)


def kv_layout(cfg: Any) -> KVLayout:
    """The cache layout of a (text) config's decoder layers."""
    layers = int(cfg.num_hidden_layers)
    shapes = _shapes(cfg)
    modes = _sharing(cfg)
    if all(m != "reuse" for m in modes):
        return KVLayout(shapes)
    kinds = list(getattr(cfg, "layer_types", None) or ["full_attention"] * layers)
    owners = [i for i in range(layers) if modes[i] != "reuse"]
    pool = {layer: n for n, layer in enumerate(owners)}
    layer_of = dict(pool)
    for i in range(layers):
        if modes[i] == "reuse":
            # The last owning layer of the same kind before it (transformers stores those).
            source = max((j for j in owners if j < i and kinds[j] == kinds[i]), default=None)
            if source is None:
                raise ValueError(f"layer {i} reuses the keys and values of an earlier {kinds[i]} layer, and there "
                                 "is none")
            layer_of[i] = pool[source]
    shared = frozenset(i for i in range(layers) if modes[i] == "reuse")
    return KVLayout([shapes[i] for i in owners], layer_of, shared)
