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

# Plugin-facing name -> the module that owns it (docs/architecture.md lists the rooms). The
# built-in plugins and the example plugin import the core through these names only
# (tests/test_public_api.py holds it), so what a third-party plugin can use is exactly what the
# built-ins use. ``progress`` (loading and download progress) is imported as a module.
_EXPORTS = {
    # records that the register_* hooks return
    **dict.fromkeys(("ProtocolSpec", "BackendSpec", "ToolParserSpec", "ReasoningParserSpec",
                     "GuidedDecoderSpec", "ProposerSpec"), "llmserve.hooks.records"),
    "PluginManager": "llmserve.hooks.manager",
    # dialects: the contract, the kit every route uses, and the one chat turn
    "Protocol": "llmserve.server.protocol",
    "ServerContext": "llmserve.server.context",
    "SharedRoute": "llmserve.server.shared",
    **dict.fromkeys(("WireModel", "dialect_router", "sse", "in_band_errors", "parse_body", "parse_model",
                     "ErrorFormat", "MalformedBodyError", "UnsupportedError", "SSE_DONE", "STREAM_HEADERS", "dumps",
                     "load_json"), "llmserve.server.dialect_kit"),
    **dict.fromkeys(("ChatTurn", "prepare_chat", "count_chat_tokens", "effort_budget", "request_images"),
                    "llmserve.server.chat_turn"),
    **dict.fromkeys(("SSE_RESPONSES", "openapi_body", "stream_responses"), "llmserve.server.openapi"),
    **dict.fromkeys(("presented_key", "public_route"), "llmserve.server.middleware"),
    "to_error": "llmserve.server.errors",
    "answers_media": "llmserve.server.negotiation",
    "while_loading": "llmserve.server.startup",
    "CONTENT_TYPE": "llmserve.server.metrics",
    "merge_scrapes": "llmserve.server.metrics",
    **dict.fromkeys(("TokenText", "chat_logprobs", "clamp_logprob"), "llmserve.text.logprob_shapes"),
    **dict.fromkeys(("build_server", "setup_logging"), "llmserve.server.serve"),
    **dict.fromkeys(("render_chat", "message_text", "message_content", "content_text", "arguments_as_object"),
                    "llmserve.text.chat_template"),
    # images in requests: the one internal image part, made from each dialect's form
    **dict.fromkeys(("ImagePart", "image_from_url", "image_from_base64", "image_from_string"),
                    "llmserve.media.parts"),
    "load_images": "llmserve.media.image",
    # images on their way to the model: a prompt's image as a backend expands it
    **dict.fromkeys(("MediaInput", "MediaProcessor", "image_digest", "reads_images", "after_cut"),
                    "llmserve.media.inputs"),
    "IncrementalDetokenizer": "llmserve.text.detokenizer",
    # the engine's request and output types, and its client
    **dict.fromkeys(("GenerateRequest", "PreparedRequest", "RequestPolicy", "ReasoningBudget",
                     "deadline_after"), "llmserve.request"),
    **dict.fromkeys(("SamplingParams", "MAX_LOGPROBS"), "llmserve.sampling"),
    **dict.fromkeys(("RequestOutput", "SequenceDelta", "TokenLogprob", "Usage"), "llmserve.outputs"),
    "EngineClient": "llmserve.engine.client",
    # models by name: a MODEL value resolved to local files (path, Hugging Face cache, download)
    **dict.fromkeys(("ModelRef", "parse_ref"), "llmserve.models.ref"),
    **dict.fromkeys(("ModelSource", "ResolvedModel", "plan_model", "resolve_model"), "llmserve.models.resolve"),
    "EngineLoop": "llmserve.engine.loop",
    # backends
    **dict.fromkeys(("Backend", "ModelInfo", "KVCacheSpec", "StepItem", "StepResult"), "llmserve.engine.backend"),
    # speculative decoding: what a register_proposers plugin implements
    **dict.fromkeys(("Proposer", "DraftRequest"), "llmserve.engine.speculation"),
    # configuration and commands
    **dict.fromkeys(("ServerConfig", "ModelConfig", "SpeculativeConfig", "load_options"), "llmserve.config"),
    **dict.fromkeys(("CONFIG_OPTION", "PanelCommand", "fail", "resolve_config", "with_config_options"),
                    "llmserve.cli"),
    # parsers
    **dict.fromkeys(("ToolParser", "ReasoningParser", "ParseDelta", "ToolCallDelta", "new_call_id"),
                    "llmserve.parsing.contract"),
    **dict.fromkeys(("StreamingToolParser", "RegionToolParser", "held_suffix"), "llmserve.parsing.streaming"),
    **dict.fromkeys(("ParseChain", "ChainMaker"), "llmserve.parsing.chain"),
    **dict.fromkeys(("CallList", "CheckedCall"), "llmserve.parsing.json_calls"),
    "JsonScanner": "llmserve.parsing.json_scan",
    "first_call_only": "llmserve.parsing.forced",
    **dict.fromkeys(("AUTO_FLAGS", "ToolPlan"), "llmserve.parsing.tool_choice"),
    # guided decoding
    **dict.fromkeys(("GuidedDecoder", "GuidedSpec", "json_schema_spec", "only_one"), "llmserve.guided"),
    "Structure": "llmserve.guided.structure",
    **dict.fromkeys(("forced_structure", "tool_parameters"), "llmserve.parsing.forced_syntax"),
    "check_deadline": "llmserve.guided.worker",
    "refuse_injected_templates": "llmserve.text.sandbox",
    # errors, rendered by every dialect in its own format
    **dict.fromkeys(("LLMServeError", "InvalidRequestError", "ContextLengthError", "NotFoundError", "GenerationError",
                     "ConfigError",
                     "EngineDeadError", "ModelLoadingError", "OverloadedError", "PayloadTooLargeError",
                     "RequestTimeoutError", "ShuttingDownError", "UnauthorizedError"), "llmserve.errors"),
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
