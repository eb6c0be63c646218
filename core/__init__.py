"""llmserve: a plugin-based LLM serving framework.

Importing this package is deliberately cheap: no torch, no transformers, no FastAPI. The names a
plugin author needs are importable from here (``from llmserve import hookimpl, ProtocolSpec,
Protocol, WireModel``); each is loaded from its module on first use, so the one import line costs
nothing until a name is touched.
"""

from __future__ import annotations

import importlib
from typing import Any

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("llmserve")

# Plugin-facing name -> the module that owns it (docs/architecture.md lists the rooms).
_EXPORTS = {
    # records that the register_* hooks return
    **dict.fromkeys(("ProtocolSpec", "BackendSpec", "ToolParserSpec", "ReasoningParserSpec",
                     "GuidedDecoderSpec"), "llmserve.hooks.records"),
    # dialects
    "Protocol": "llmserve.server.protocol",
    "ServerContext": "llmserve.server.context",
    "SharedRoute": "llmserve.server.shared",
    **dict.fromkeys(("WireModel", "dialect_router", "sse", "in_band_errors", "parse_body", "parse_model"),
                    "llmserve.server.dialect_kit"),
    # the engine's request and output types
    **dict.fromkeys(("GenerateRequest", "PreparedRequest", "RequestPolicy"), "llmserve.request"),
    "SamplingParams": "llmserve.sampling",
    **dict.fromkeys(("RequestOutput", "SequenceDelta", "TokenLogprob", "Usage"), "llmserve.outputs"),
    # backends
    **dict.fromkeys(("Backend", "ModelInfo", "KVCacheSpec", "StepItem", "StepResult"), "llmserve.engine.backend"),
    # parsers
    **dict.fromkeys(("ToolParser", "ReasoningParser", "ParseDelta", "ToolCallDelta", "new_call_id"),
                    "llmserve.parsing.contract"),
    **dict.fromkeys(("StreamingToolParser", "RegionToolParser"), "llmserve.parsing.streaming"),
    # guided decoding
    **dict.fromkeys(("GuidedDecoder", "GuidedSpec"), "llmserve.guided"),
    # errors, rendered by every dialect in its own format
    **dict.fromkeys(("LLMServeError", "InvalidRequestError", "NotFoundError", "GenerationError", "ConfigError"),
                    "llmserve.errors"),
}

__all__ = ["__version__", "hookimpl", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'llmserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
