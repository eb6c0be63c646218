"""Which files of a repo to fetch and serve, from its file listing alone (no network, no disk).

- A safetensors repo: the config, tokenizer files, chat template, generation config and the
  top-level ``*.safetensors`` with their index. Nothing else (no ``*.bin``, no sub-folders).
- A GGUF repo: one model, named by its quant (``Q4_K_M`` by default, else the only or first GGUF);
  a split model (``name-00001-of-00003.gguf``) is all of its parts; vision projectors
  (``mmproj``) only when asked.
- A repo whose only weights are pickles (``*.bin``, ``*.pt``, ...) is refused: they are never
  fetched, let alone unpickled.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field

from llmserve.errors import ConfigError
from llmserve.models.ref import DEFAULT_QUANT, ModelRef

MAX_FILES = 10_000  # a listing longer than this is refused (no model repo comes near it)
SIDE_FILES = frozenset({
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
    "chat_template.jinja", "chat_template.json", "model.safetensors.index.json",
})
PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
SPLIT = re.compile(r"(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf", re.IGNORECASE)
# A quant as GGUF file names carry it: Q4_K_M, IQ4_XS, Q8_0, BF16, F16, MXFP4, TQ1_0 ...
_QUANT_TOKEN = re.compile(r"(?<![a-z0-9])(i?q[1-8](?:_[a-z0-9]+)*|tq[12]_0|bf16|fp16|f16|f32|mxfp4)(?![a-z0-9])",
                          re.IGNORECASE)


@dataclass
class Selection:
    """What to fetch (``files``, repo-relative) and what to serve: ``serve`` is ``""`` for the
    snapshot directory (safetensors) or the GGUF file (a split model's first part)."""

    kind: str  # "safetensors" or "gguf"
    files: list[str]
    serve: str = ""
    quant: str | None = None
    notes: list[str] = field(default_factory=list)  # choices worth a log line


def quant_of(path: str) -> str | None:
    """The quant a GGUF file name carries (``Q4_K_M``), upper-cased, or None."""
    stem = posixpath.basename(path)
    split = SPLIT.fullmatch(stem)
    stem = split.group("stem") if split else re.sub(r"\.gguf$", "", stem, flags=re.IGNORECASE)
    found = _QUANT_TOKEN.findall(stem) or _QUANT_TOKEN.findall(posixpath.dirname(path))
    return found[-1].upper() if found else None


def carries_quant(path: str, quant: str) -> bool:
    return re.search(rf"(?<![a-z0-9]){re.escape(quant)}(?![a-z0-9_])", path, re.IGNORECASE) is not None


def gguf_models(names: list[str]) -> dict[str, list[str]]:
    """The GGUF models of a listing: label (the file, or a split model's first part) -> its files."""
    models: dict[str, list[str]] = {}
    splits: dict[tuple[str, str], dict[int, str]] = {}
    for name in sorted(names):
        if not name.lower().endswith(".gguf"):
            continue
        match = SPLIT.fullmatch(posixpath.basename(name))
        if match is None:
            models[name] = [name]
            continue
        key = (posixpath.join(posixpath.dirname(name), match.group("stem")), match.group("count"))
        splits.setdefault(key, {})[int(match.group("part"))] = name
    for (stem, count), parts in splits.items():
        want = int(count)
        if sorted(parts) != list(range(1, want + 1)):
            raise ConfigError(f"split GGUF {stem} has {len(parts)} of its {want} parts in the repo "
                              f"(parts {sorted(parts)}): it cannot be served")
        models[parts[1]] = [parts[i] for i in range(1, want + 1)]
    return dict(sorted(models.items()))


def _is_mmproj(path: str) -> bool:
    return "mmproj" in posixpath.basename(path).lower()


def _pick_gguf(ref: ModelRef, models: dict[str, list[str]], mmproj: bool) -> Selection:
    weights = {label: files for label, files in models.items() if not _is_mmproj(label)}
    projectors = [label for label in models if _is_mmproj(label)]
    if not weights:
        raise ConfigError(f"{ref.repo} holds no GGUF model, only vision projectors ({', '.join(projectors)})")
    notes = []
    if ref.quant:
        matches = [label for label in weights if carries_quant(label, ref.quant)]
        if not matches:
            quants = sorted({q for q in map(quant_of, weights) if q})
            raise ConfigError(f"no GGUF file of {ref.repo} carries the quant {ref.quant}: it has "
                              f"{', '.join(quants) or ', '.join(weights)}")
    else:
        matches = [label for label in weights if carries_quant(label, DEFAULT_QUANT)]
        if not matches:
            matches = list(weights)
            if len(weights) > 1:
                notes.append(f"no :QUANT given and no {DEFAULT_QUANT} file in {ref.repo}: serving {matches[0]}, the "
                             f"first of {len(weights)} GGUF models")
    chosen = matches[0]
    if len(matches) > 1 and ref.quant:
        notes.append(f"{len(matches)} GGUF models of {ref.repo} carry {ref.quant}: serving {chosen} "
                     f"(others: {', '.join(matches[1:])})")
    files = list(weights[chosen])
    if mmproj and projectors:
        best = next((p for p in projectors if "f16" in p.lower()), projectors[0])
        files.extend(models[best])
    quant = (ref.quant or quant_of(chosen) or "").upper() or None
    return Selection("gguf", files, serve=chosen, quant=quant, notes=notes)


def select_files(ref: ModelRef, names: list[str], mmproj: bool = False) -> Selection:
    """The ``Selection`` of repo ``ref`` given its file ``names`` (repo-relative)."""
    if len(names) > MAX_FILES:
        raise ConfigError(f"{ref.repo} lists {len(names)} files, more than a model repo holds (at most "
                          f"{MAX_FILES} are read): not fetched")
    bad = [n for n in names if n.startswith("/") or "\\" in n or ".." in n.split("/")]
    if bad:
        raise ConfigError(f"{ref.repo} lists a file name that climbs out of its folder ({bad[0][:80]!r}): not fetched")
    models = gguf_models(names)
    top = [n for n in names if "/" not in n]
    tensors = [n for n in top if n.endswith(".safetensors")]
    if models and (ref.quant or not tensors):
        return _pick_gguf(ref, models, mmproj)
    if tensors:
        if ref.quant:
            raise ConfigError(f"{ref.repo} holds safetensors, not GGUF files: serve it as {ref.repo} (no :QUANT)")
        side = [n for n in top if n in SIDE_FILES or n.endswith(".safetensors.index.json")]
        if "config.json" not in side:
            raise ConfigError(f"{ref.repo} has safetensors but no config.json: not a Hugging Face model repo")
        return Selection("safetensors", sorted(set(side) | set(tensors)))
    pickles = [n for n in names if n.lower().endswith(PICKLES)]
    if pickles:
        raise ConfigError(f"{ref.repo} has only pickled weights ({posixpath.basename(pickles[0])}, ...), which "
                          "llmserve never loads (unpickling runs code): use a safetensors or GGUF repo of this model")
    raise ConfigError(f"{ref.repo} holds no model weights llmserve serves (no *.safetensors, no *.gguf)")
