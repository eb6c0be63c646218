"""The language model of a multimodal checkpoint read alone (``architectures.LANGUAGE_ONLY``):
loaded by its own causal-LM class under that class's weight names, the other towers' weights
never read, and refused when the checkpoint does not hold exactly the weights it needs."""

from __future__ import annotations

import logging
import re
from contextlib import contextmanager
from typing import Any, Iterator

from llmserve import ConfigError

from .architectures import LANGUAGE_ONLY

# The multimodal class keeps its language model under ``model.language_model``; the causal-LM
# class under ``model``.
KEY_MAPPING = {r"^model\.language_model\.": "model."}
_OTHER_TOWERS = re.compile(r"vision|audio")


def load_arguments(hf_config: Any) -> dict[str, Any]:
    """``from_pretrained`` arguments that read the language model alone (empty for a checkpoint
    that is not read so)."""
    if getattr(hf_config, "model_type", None) not in LANGUAGE_ONLY:
        return {}
    return {"config": hf_config.get_text_config(), "key_mapping": KEY_MAPPING, "output_loading_info": True}


@contextmanager
def load_report(quiet: bool) -> Iterator[None]:
    """transformers' load report (a table of every key it left out) held back when ``quiet``: the
    other towers' keys are left out by design, and ``check`` says what matters."""
    hf_log = logging.getLogger("transformers.modeling_utils")
    level = hf_log.level
    if quiet:
        hf_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hf_log.setLevel(level)


def check(report: dict[str, Any], shown: str) -> None:
    """Refuse a language model whose checkpoint lacks some of its weights (they would be random)
    or holds language-model weights it did not take (another layout)."""
    missing = sorted(report.get("missing_keys") or ())
    stray = sorted(k for k in report.get("unexpected_keys") or () if not _OTHER_TOWERS.search(k))
    if missing:
        what = f"lacks {len(missing)} of its weights ({missing[0]}, ...)"
    elif stray:
        what = f"holds {len(stray)} weights it does not take ({stray[0]}, ...)"
    else:
        return
    raise ConfigError(f"model {shown!r}: the language model read from its checkpoint {what}; the checkpoint is not "
                      "laid out as transformers lays this architecture out")
