"""What ``/api/tags``, ``/api/show`` and ``/api/ps`` say about the served model.

Facts come from the loaded model's directory, read once and without loading weights: the
architecture and sizes from ``config.json``, the parameter count from the safetensors
headers (a few kilobytes each), or from the backend's ``ModelInfo`` when it knows them (a GGUF
served in its own quantization). What cannot be known is left empty rather than invented.
``quantization_level`` is the precision the server computes in, ``size`` the bytes of the
weights as served.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from llmserve import reads_images

from .params import listed_name

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_LEVEL = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
#: ``expires_at`` of a model that is never unloaded (Ollama shows a far-future time for keep_alive -1).
NEVER = "2318-01-01T00:00:00Z"
_HEADER_LIMIT = 64 * 1024 * 1024  # a safetensors header larger than this is not read


@dataclass
class ModelFacts:
    family: str = ""
    parameters: int = 0
    config: dict[str, Any] = field(default_factory=dict)
    modified: float = 0.0


def _safetensors_parameters(path: str) -> int:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > _HEADER_LIMIT:
            return 0
        header = json.loads(f.read(size))
    total = 0
    for name, entry in header.items():
        if name != "__metadata__" and isinstance(entry, dict):
            count = 1
            for dim in entry.get("shape", []):
                count *= int(dim)
            total += count
    return total


def read_facts(info: Any) -> ModelFacts:
    """Facts about ``info`` (the backend's ``ModelInfo``); empty ones where files are missing."""
    facts = ModelFacts()
    folder = getattr(info.tokenizer, "name_or_path", "") or ""
    if not os.path.isdir(folder):
        folder = info.path if os.path.isdir(info.path) else ""
    try:
        facts.modified = os.path.getmtime(info.path)
    except OSError:
        pass
    facts.parameters = int(getattr(info, "num_parameters", None) or 0)
    if not folder:
        return facts
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            facts.config = json.load(f)
    except (OSError, ValueError):
        pass
    if isinstance(facts.config.get("text_config"), dict):
        facts.config = {**facts.config, **facts.config["text_config"]}
    facts.family = str(facts.config.get("model_type") or "")
    for name in sorted(os.listdir(folder)) if not facts.parameters else ():
        if name.endswith(".safetensors"):
            try:
                facts.parameters += _safetensors_parameters(os.path.join(folder, name))
            except (OSError, ValueError, struct.error):
                facts.parameters = 0
                break
    return facts


def human_count(n: int) -> str:
    """Ollama's parameter_size spelling: 134.52M, 8.0B."""
    if n <= 0:
        return ""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            value = n / scale
            return f"{value:.1f}{unit}" if value >= 100 or unit == "B" else f"{value:.2f}{unit}"
    return str(n)


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts or 0, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class ModelCard:
    """One served model as Ollama describes models (``slot``: the server's ``ModelSlot``; None:
    the current request's model); facts are read on first use."""

    def __init__(self, context: Any, slot: Any = None) -> None:
        self.context = context
        self._slot = slot
        self._facts: dict[int, ModelFacts] = {}

    @property
    def info(self) -> Any:
        return self._slot.model if self._slot is not None else self.context.model

    @property
    def slot(self) -> Any:
        return self._slot if self._slot is not None else self.context.slot

    @property
    def facts(self) -> ModelFacts:
        info = self.info
        if id(info) not in self._facts:
            self._facts = {id(info): read_facts(info)}  # the loaded model's: a reload reads them again
        return self._facts[id(info)]

    def _size(self) -> int:
        served = getattr(self.info, "weight_bytes", None)
        return int(served) if served else self.facts.parameters * _BYTES.get(self.info.dtype, 4)

    def details(self) -> dict[str, Any]:
        info, facts = self.info, self.facts
        return {"parent_model": "", "format": "gguf" if info.path.lower().endswith(".gguf") else "safetensors",
                "family": facts.family, "families": [facts.family] if facts.family else None,
                "parameter_size": human_count(facts.parameters),
                "quantization_level": _LEVEL.get(info.dtype, info.dtype.upper())}

    def digest(self, name: str) -> str:
        return hashlib.sha256(f"{name}|{self.info.path}|{self.facts.modified}".encode()).hexdigest()

    def entries(self) -> list[tuple[str, str]]:
        """(listed name, served name) of every served name."""
        return [(listed_name(n), n) for n in dict.fromkeys(self.slot.served_names)]

    def tags(self) -> list[dict[str, Any]]:
        if self.info is None:  # not loaded: what its files say
            return [unloaded_tag(self.slot, listed, served) for listed, served in self.entries()]
        return [{"name": listed, "model": listed, "modified_at": _iso(self.facts.modified),
                 "size": self._size(), "digest": self.digest(served), "details": self.details()}
                for listed, served in self.entries()]

    def ps(self) -> list[dict[str, Any]]:
        size = self._size()
        slot = self.slot
        on_gpu = self.info.device.startswith("cuda")
        expires = NEVER if slot.pinned or slot.expires_at is None else _iso(time.time() + slot.expires_at
                                                                          - time.monotonic())
        return [{"name": listed, "model": listed, "size": size, "digest": self.digest(served),
                 "details": self.details(), "expires_at": expires, "size_vram": size if on_gpu else 0,
                 "context_length": slot.engine.max_model_len}
                for listed, served in self.entries()]

    def capabilities(self) -> list[str]:
        parsing = self.context.parsing
        if self.info.task == "embed":
            return ["embedding"]
        caps = ["completion"]
        if parsing.auto_tools:
            caps.append("tools")
        if parsing.reasoning_parser:
            caps.append("thinking")
        if reads_images(self.info):  # Ollama's word for a model that reads images
            caps.append("vision")
        return caps

    def model_info(self) -> dict[str, Any]:
        c, arch = self.facts.config, self.facts.family or "llm"
        out: dict[str, Any] = {"general.architecture": arch, "general.basename": self.info.name}
        if self.facts.parameters:
            out["general.parameter_count"] = self.facts.parameters
        out[f"{arch}.context_length"] = self.slot.engine.max_model_len
        for key, name in (("hidden_size", "embedding_length"), ("num_hidden_layers", "block_count"),
                          ("num_attention_heads", "attention.head_count"),
                          ("num_key_value_heads", "attention.head_count_kv"),
                          ("intermediate_size", "feed_forward_length"), ("rope_theta", "rope.freq_base"),
                          ("rms_norm_eps", "attention.layer_norm_rms_epsilon"), ("vocab_size", "vocab_size")):
            if isinstance(c.get(key), (int, float)):
                out[f"{arch}.{name}"] = c[key]
        return out

    def show(self) -> dict[str, Any]:
        info = self.info
        template = info.chat_template or getattr(info.tokenizer, "chat_template", None) or ""
        return {"license": "", "modelfile": f"# Modelfile generated by llmserve\nFROM {info.name}\n",
                "parameters": f"num_ctx {self.slot.engine.max_model_len}", "template": template,
                "details": self.details(), "model_info": self.model_info(), "capabilities": self.capabilities(),
                "modified_at": _iso(self.facts.modified)}


def unloaded_tag(slot: Any, listed: str, served: str) -> dict[str, Any]:
    """An ``/api/tags`` entry of a model not loaded now: its format, size and time from its files."""
    source = slot.source
    files = [source] if os.path.isfile(source) else (
        [os.path.join(source, n) for n in os.listdir(source)] if os.path.isdir(source) else [])
    size, modified = 0, 0.0
    for path in files:
        try:
            stat = os.stat(path)
        except OSError:
            continue
        size, modified = size + stat.st_size, max(modified, stat.st_mtime)
    fmt = "gguf" if source.lower().endswith(".gguf") else "safetensors"
    return {"name": listed, "model": listed, "modified_at": _iso(modified), "size": size,
            "digest": hashlib.sha256(f"{served}|{source}|{modified}".encode()).hexdigest(),
            "details": {"parent_model": "", "format": fmt, "family": "", "families": None, "parameter_size": "",
                        "quantization_level": ""}}
