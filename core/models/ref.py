"""What a ``MODEL`` value names: a local path, or a Hugging Face repo id with an optional GGUF quant
(``org/name[:QUANT]``, also spelled ``hf.co/org/name:QUANT`` as Ollama takes it).

Parsing is strict on purpose: a repo id becomes a directory name in the Hugging Face cache, and a
revision a file under it, so anything that could climb out of the cache (``..``, absolute paths,
backslashes, a second ``:``) is refused here, before any file or network is touched.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

from llmserve.errors import ConfigError

log = logging.getLogger("llmserve.models")

# One part of a repo id: letters, digits, '.', '_', '-', starting and ending with a letter or digit
# (the Hub's own rule), at most 96 characters; '--' and '..' are refused by ``_part_ok``.
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_QUANT = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,38}[A-Za-z0-9])?"
_REF = re.compile(rf"(?:(?:hf\.co|huggingface\.co)/)?({_PART})/({_PART})(?::({_QUANT}))?")
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")
DEFAULT_QUANT = "Q4_K_M"
SHAPE = "org/name or org/name:QUANT (letters, digits, '.', '_' and '-')"


@dataclass(frozen=True)
class ModelRef:
    """A Hugging Face model repo and, for a GGUF repo, the quant asked for (None: the default)."""

    repo: str
    quant: str | None = None

    @property
    def name(self) -> str:
        """The reference as the user would type it again: ``org/name`` or ``org/name:QUANT``."""
        return f"{self.repo}:{self.quant}" if self.quant else self.repo

    @property
    def cache_folder(self) -> str:
        """The repo's folder name in the Hugging Face cache (``models--org--name``)."""
        return "models--" + self.repo.replace("/", "--")


def _part_ok(part: str) -> bool:
    return ".." not in part and "--" not in part


def parse_ref(text: str) -> ModelRef | None:
    """The ``ModelRef`` that ``text`` spells, or None when it is not a repo id at all."""
    match = _REF.fullmatch(text.strip())
    if match is None or not (_part_ok(match.group(1)) and _part_ok(match.group(2))):
        return None
    quant = match.group(3)
    if quant is not None and ".." in quant:
        return None
    return ModelRef(f"{match.group(1)}/{match.group(2)}", quant)


def require_ref(text: str) -> ModelRef:
    """``parse_ref`` for commands that take only a repo id (``pull``, ``rm``): a one-line error else."""
    ref = parse_ref(text)
    if ref is None:
        raise ConfigError(f"{shown(text)} is not a Hugging Face repo id: expected {SHAPE}")
    return ref


def check_revision(revision: str | None) -> str | None:
    """``--revision`` as a branch, tag or commit: it names a file under the cache's ``refs/``, so
    ``..``, a leading '/' or a backslash is refused."""
    if revision is None:
        return None
    if not _REVISION.fullmatch(revision) or ".." in revision or "//" in revision or revision.endswith("/"):
        raise ConfigError(f"--revision {shown(revision)} is not a branch, tag or commit name (letters, digits, "
                          "'.', '_', '-' and '/', no '..')")
    return revision


def shown(text: str, limit: int = 80) -> str:
    """``text`` quoted for an error line, cut to ``limit`` characters (a 1 MB name stays one line)."""
    cut = text if len(text) <= limit else text[:limit] + "..."
    return repr(cut)


def _path_like(text: str) -> bool:
    return (text.startswith(("/", ".", "~")) or "\\" in text or "/" not in text
            or text.lower().endswith(".gguf") or os.path.isabs(text))


def classify(text: str) -> ModelRef | None:
    """None when ``text`` is a local path (existing, or shaped like one: the backend reports a
    missing one), else its ``ModelRef``; a value that is neither is a one-line error.

    An existing path wins over a repo id of the same spelling, and the choice is logged."""
    ref = parse_ref(text)
    if os.path.exists(os.path.expanduser(text)):
        if ref is not None:
            log.info("%s is a local path and also a Hugging Face repo id: serving the local path", shown(text))
        return None
    if ref is not None:
        return ref
    if _path_like(text) and "\x00" not in text:
        return None
    raise ConfigError(f"model {shown(text)} is neither an existing path nor a Hugging Face repo id ({SHAPE})")
