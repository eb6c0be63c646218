"""The torch backend's environment switches (for comparisons and debugging, not tuning knobs).

``LLMSERVE_FUSED_FORWARD=0`` keeps transformers' modules instead of the fused forward;
``LLMSERVE_CPU_KERNELS=0`` keeps everything on torch instead of the native CPU kernels (decode
attention, packed linears, norms, RoPE, greedy picking); ``LLMSERVE_NATIVE_STEP=0`` runs decode
steps through the fused forward's Python layer loop instead of the one-call native step;
``LLMSERVE_COMPACT_WEIGHTS=0`` keeps every packed linear in fp32 panels, even where lossless
4- or 8-bit panels would reproduce the weights.
"""

from __future__ import annotations

import os

FUSED_FORWARD = "LLMSERVE_FUSED_FORWARD"
CPU_KERNELS = "LLMSERVE_CPU_KERNELS"
NATIVE_STEP = "LLMSERVE_NATIVE_STEP"
COMPACT_WEIGHTS = "LLMSERVE_COMPACT_WEIGHTS"


def enabled(name: str) -> bool:
    """True unless the variable is set to 0 / false / no / off (any case)."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")
