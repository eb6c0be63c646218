"""Server-wide sampling defaults: the model's ``generation_config.json`` values (``--generation-config``)
and seeds drawn from ``--seed``, filled into what a request leaves unset."""

from __future__ import annotations

import itertools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from llmserve.config import ModelConfig
from llmserve.errors import ConfigError
from llmserve.sampling import SamplingParams

log = logging.getLogger("llmserve.engine")

GENERATION_CONFIG = "generation_config.json"
# generation_config.json keys that become defaults (the ones vLLM takes), and their sampling field.
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
_MASK64 = 2**64 - 1


def _mix(value: int) -> int:
    """splitmix64's finalizer: neighbouring counters give unrelated seeds."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (value ^ (value >> 31)) & (2**63 - 1)


def read_generation_defaults(setting: str, model: str | None) -> dict[str, Any]:
    """The sampling defaults ``--generation-config`` names: ``vllm`` none; ``auto`` those of the
    model directory's file (none for a .gguf file, a hub id or a directory without the file); a
    directory path those of the file it must hold. Values a request could not send are dropped
    with a warning. Raises ``ConfigError`` for a directory without the file or a broken file."""
    if setting == "vllm":
        return {}
    if setting == "auto":
        if not model or not Path(model, GENERATION_CONFIG).is_file():
            return {}
        path = Path(model, GENERATION_CONFIG)
    else:
        path = Path(setting).expanduser()
        path = path if path.name == GENERATION_CONFIG else path / GENERATION_CONFIG
        if not path.is_file():
            raise ConfigError(f"--generation-config: {setting!r} is not auto, vllm or a directory holding a "
                              f"{GENERATION_CONFIG}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--generation-config: cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--generation-config: {path} is not a JSON object")
    out: dict[str, Any] = {}
    for key, name in _KEYS.items():
        if data.get(key) is None:
            continue
        try:
            SamplingParams(**{name: data[key]})
        except ValidationError:
            log.warning("%s: ignoring %s=%r (not a valid value)", path, key, data[key])
            continue
        out[name] = data[key]
    if out:
        log.info("default sampling parameters from %s: %s (requests override them; --generation-config vllm "
                 "ignores the file)", path, ", ".join(f"{k}={v}" for k, v in out.items()))
    return out


@dataclass(slots=True)
class SamplingDefaults:
    """What fills a request's unset sampling fields (``SamplingParams.model_fields_set``)."""

    values: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    _counter: Any = field(default_factory=itertools.count)

    @classmethod
    def from_config(cls, model: ModelConfig) -> "SamplingDefaults":
        """``--generation-config`` and ``--seed`` of the model section."""
        return cls(values=read_generation_defaults(model.generation_config, model.model), seed=model.seed)

    def apply(self, sampling: SamplingParams, prompt_len: int, max_model_len: int) -> SamplingParams:
        """``sampling`` with the defaults in the fields its request left unset. Idempotent: a field
        filled here counts as set. A default ``max_tokens`` is cut to the room the prompt leaves."""
        given = sampling.model_fields_set
        update = {k: v for k, v in self.values.items() if k not in given}
        if "max_tokens" in update:
            update["max_tokens"] = max(1, min(int(update["max_tokens"]), max_model_len - prompt_len))
            if sampling.min_tokens > update["max_tokens"]:
                del update["max_tokens"]
        if self.seed is not None and "seed" not in given:
            # next() on itertools.count is atomic under the GIL: each request its own draw.
            update["seed"] = _mix(self.seed * 0x100000001 + next(self._counter))
        return sampling.model_copy(update=update) if update else sampling
