"""The local Hugging Face cache, read without the network: where it is, which snapshot a repo and
revision name, whether a selection is complete there, and what ``llmserve ls`` / ``rm`` show and
delete.

Layout (huggingface_hub's, shared with transformers, vLLM and llama.cpp):
``<cache>/models--org--name/{blobs/<hash>, snapshots/<commit>/<file> -> ../../blobs/<hash>,
refs/<revision> (a commit)}``. A file appears under ``snapshots/`` only once fully downloaded.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import time
from dataclasses import dataclass

from llmserve.errors import ConfigError
from llmserve.models.ref import ModelRef, parse_ref
from llmserve.models.select import Selection, carries_quant, gguf_models, quant_of, select_files

_COMMIT = re.compile(r"[0-9a-f]{40}")


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def hub_cache_dir() -> str:
    """The Hugging Face hub cache, from the environment as huggingface_hub reads it (read at each
    call, so a test or a parent process can point it elsewhere)."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return os.path.expanduser(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"])
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def env_offline() -> bool:
    """``HF_HUB_OFFLINE`` is set (huggingface_hub's switch, which transformers and vLLM honour too)."""
    return _truthy(os.environ.get("HF_HUB_OFFLINE"))


def repo_dir(cache: str, ref: ModelRef) -> str:
    return os.path.join(cache, ref.cache_folder)


def snapshot_dir(cache: str, ref: ModelRef, revision: str | None) -> str | None:
    """The cached snapshot ``revision`` (default ``main``) of ``ref``, or None."""
    root = repo_dir(cache, ref)
    commit = revision if revision and _COMMIT.fullmatch(revision) else None
    if commit is None:
        try:
            with open(os.path.join(root, "refs", revision or "main"), encoding="utf-8") as fh:
                commit = fh.read().strip()
        except OSError:
            return None
        if not _COMMIT.fullmatch(commit):
            return None
    path = os.path.join(root, "snapshots", commit)
    return path if os.path.isdir(path) else None


def snapshot_files(folder: str) -> list[str]:
    """Repo-relative names of the complete files of a snapshot."""
    names = []
    for here, _, files in os.walk(folder):
        for name in files:
            full = os.path.join(here, name)
            if os.path.isfile(full):  # a dangling link is not a file
                names.append(os.path.relpath(full, folder).replace(os.sep, "/"))
    return sorted(names)


def _index_complete(folder: str, files: list[str]) -> bool:
    index = os.path.join(folder, "model.safetensors.index.json")
    if not os.path.isfile(index):
        return True
    try:
        with open(index, encoding="utf-8") as fh:
            shards = set(json.load(fh).get("weight_map", {}).values())
    except (OSError, ValueError, AttributeError):
        return False
    return shards <= set(files)


def cached_selection(cache: str, ref: ModelRef, revision: str | None,
                     mmproj: bool = False) -> tuple[str, Selection] | None:
    """(snapshot folder, selection) when the cache holds everything ``ref`` needs, else None."""
    folder = snapshot_dir(cache, ref, revision)
    if folder is None:
        return None
    files = snapshot_files(folder)
    try:
        selection = select_files(ref, files, mmproj)
    except ConfigError:
        return None  # the cache holds too little to choose from: the Hub decides
    if selection.kind == "safetensors" and not _index_complete(folder, files):
        return None
    return folder, selection


def mark_used(folder: str, files: list[str]) -> None:
    """Set the access time of the files' blobs to now (their modification time kept), so ``ls``
    says when a model was last served even on file systems mounted ``noatime``."""
    now = time.time()
    for name in files:
        path = os.path.realpath(os.path.join(folder, name))
        try:
            os.utime(path, (now, os.stat(path).st_mtime))
        except OSError:
            pass


def gguf_architecture(path: str) -> str | None:
    """``general.architecture`` of a GGUF file, read from its first metadata entries."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(1 << 16)
    except OSError:
        return None
    if head[:4] != b"GGUF":
        return None
    try:  # a file cut short (or only its magic) has no architecture to read, and is no error here
        pos, count = 24, struct.unpack_from("<Q", head, 16)[0]
        for _ in range(min(count, 64)):
            (n,) = struct.unpack_from("<Q", head, pos)
            key = head[pos + 8:pos + 8 + n].decode("utf-8", "replace")
            pos += 8 + n
            (vtype,) = struct.unpack_from("<I", head, pos)
            pos += 4
            if vtype != 8:  # only strings lead the header in practice; stop at anything else
                return None
            (n,) = struct.unpack_from("<Q", head, pos)
            value = head[pos + 8:pos + 8 + n].decode("utf-8", "replace")
            pos += 8 + n
            if key == "general.architecture":
                return value
    except struct.error:
        return None
    return None


def _config_architecture(folder: str) -> str | None:
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError):
        return None
    archs = config.get("architectures") if isinstance(config, dict) else None
    return str(archs[0]) if isinstance(archs, list) and archs else (config.get("model_type") if isinstance(config, dict)
                                                                    else None)


@dataclass
class CachedModel:
    """One servable thing in the cache: a safetensors snapshot, or one GGUF model (a quant)."""

    name: str                 # what ``serve`` / ``rm`` take: org/name or org/name:QUANT
    repo: str
    quant: str | None
    architecture: str | None
    files: list[str]
    size: int                 # bytes on disk (each blob counted once)
    last_used: float          # newest access time of its blobs (epoch seconds)
    revision: str             # the commit
    path: str                 # what ``serve`` loads: the snapshot folder or the GGUF file

    def as_json(self) -> dict[str, object]:
        return {"name": self.name, "repo": self.repo, "quant": self.quant, "architecture": self.architecture,
                "files": self.files, "size": self.size, "last_used": self.last_used, "revision": self.revision,
                "path": self.path}


def _measure(folder: str, files: list[str]) -> tuple[int, float]:
    blobs: dict[str, os.stat_result] = {}
    for name in files:
        path = os.path.realpath(os.path.join(folder, name))
        try:
            blobs[path] = os.stat(path)
        except OSError:
            continue
    return sum(s.st_size for s in blobs.values()), max((s.st_atime for s in blobs.values()), default=0.0)


def _snapshot_models(repo: str, commit: str, folder: str) -> list[CachedModel]:
    files = snapshot_files(folder)
    out = []
    ref = ModelRef(repo)
    try:
        models = gguf_models(files)
    except ConfigError:
        models = {}
    for label, parts in models.items():
        if "mmproj" in os.path.basename(label).lower():
            continue
        quant = quant_of(label)
        size, used = _measure(folder, parts)
        out.append(CachedModel(f"{repo}:{quant}" if quant else repo, repo, quant,
                               gguf_architecture(os.path.join(folder, label)), parts, size, used, commit,
                               os.path.join(folder, label)))
    tensors = [f for f in files if "/" not in f and f.endswith(".safetensors")]
    if tensors and "config.json" in files:
        chosen = select_files(ref, [f for f in files if "/" not in f and not f.endswith(".gguf")]).files
        size, used = _measure(folder, chosen)
        out.append(CachedModel(repo, repo, None, _config_architecture(folder), chosen, size, used, commit, folder))
    return out


def list_cached(cache: str | None = None) -> list[CachedModel]:
    """Every servable model in the cache, newest snapshot first within a repo."""
    cache = cache or hub_cache_dir()
    found: list[CachedModel] = []
    try:
        entries = sorted(os.listdir(cache))
    except OSError:
        return []
    for entry in entries:
        if not entry.startswith("models--"):
            continue
        ref = parse_ref(entry[len("models--"):].replace("--", "/", 1))
        snapshots = os.path.join(cache, entry, "snapshots")
        if ref is None or not os.path.isdir(snapshots):
            continue
        commits = sorted(os.listdir(snapshots), key=lambda c: -os.path.getmtime(os.path.join(snapshots, c)))
        for commit in commits:
            if _COMMIT.fullmatch(commit):
                found.extend(_snapshot_models(ref.repo, commit, os.path.join(snapshots, commit)))
    return found


def _inside(path: str, root: str) -> bool:
    real, base = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([real, base]) == base


def remove_cached(ref: ModelRef, cache: str | None = None) -> list[str]:
    """Delete ``ref`` from the cache: the whole repo (every revision), or with a quant that GGUF
    model's files in every snapshot (and the blobs no remaining file points to). Returns the
    repo-relative files removed; a ref the cache does not hold is a one-line error."""
    cache = cache or hub_cache_dir()
    root = repo_dir(cache, ref)
    if not os.path.isdir(root) or not _inside(root, cache):
        raise ConfigError(f"{ref.name} is not in the Hugging Face cache ({cache}): nothing removed")
    snapshots = os.path.join(root, "snapshots")
    folders = [os.path.join(snapshots, c) for c in (os.listdir(snapshots) if os.path.isdir(snapshots) else [])]
    if ref.quant is None:
        removed = sorted({f for folder in folders for f in snapshot_files(folder)})
        shutil.rmtree(root)
        shutil.rmtree(os.path.join(cache, ".locks", ref.cache_folder), ignore_errors=True)
        return removed
    removed = []
    for folder in folders:
        try:
            models = gguf_models(snapshot_files(folder))
        except ConfigError:
            continue
        for label, parts in models.items():
            if carries_quant(label, ref.quant):
                for name in parts:
                    os.unlink(os.path.join(folder, name))
                    removed.append(name)
    if not removed:
        raise ConfigError(f"no GGUF file of {ref.repo} carrying {ref.quant} is in the cache: nothing removed")
    kept = {os.path.realpath(os.path.join(here, name)) for folder in folders
            for here, _, names in os.walk(folder) for name in names}
    blobs = os.path.join(root, "blobs")
    for blob in os.listdir(blobs) if os.path.isdir(blobs) else []:
        path = os.path.join(blobs, blob)
        if os.path.realpath(path) not in kept and _inside(path, root):
            os.unlink(path)
    return sorted(set(removed))
