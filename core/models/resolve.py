"""From a ``MODEL`` value to the local path a backend loads, in this order: an existing local path;
a Hugging Face repo id whose files are in the local cache; else a download into that cache,
unless offline (``--offline`` or ``HF_HUB_OFFLINE=1``), where a miss is one line naming the
command that fetches it.

``plan_model`` does everything that needs neither the network nor much time (parsing, the cache
lookup, the offline refusal), so a server fails at once on a bad value; ``ModelSource.resolve``
then fetches what is missing (on the server's loading thread, while ``/ready`` says what is being
fetched). Both work on one model: a registry of several models calls them once per model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from llmserve.config import ModelConfig
from llmserve.errors import ConfigError
from llmserve.models.cache import cached_selection, env_offline, hub_cache_dir, mark_used
from llmserve.models.hub import Hub, fetch
from llmserve.models.ref import ModelRef, check_revision, classify
from llmserve.models.select import Selection

log = logging.getLogger("llmserve.models")


@dataclass
class ResolvedModel:
    """A model ready to load: ``path`` (a directory or a GGUF file; a split GGUF's first part),
    the name to serve it under, and for a Hub model its repo, commit folder and files."""

    path: str
    name: str
    ref: ModelRef | None = None
    snapshot: str | None = None
    selection: Selection | None = None
    fetched: bool = False

    def as_json(self) -> dict[str, object]:
        sel = self.selection
        return {"name": self.name, "path": self.path, "repo": self.ref.repo if self.ref else None,
                "quant": sel.quant if sel else None, "kind": sel.kind if sel else None,
                "files": sel.files if sel else [], "snapshot": self.snapshot, "fetched": self.fetched}


@dataclass
class ModelSource:
    """One ``MODEL`` value, looked up: ``ref`` None for a local path, ``cached`` set on a cache hit."""

    text: str
    ref: ModelRef | None = None
    revision: str | None = None
    offline: bool = False
    mmproj: bool = False
    hub: Hub | None = None
    cached: tuple[str, Selection] | None = field(default=None, repr=False)

    def pull_command(self) -> str:
        assert self.ref is not None
        extra = f" --revision {self.revision}" if self.revision else ""
        return f"llmserve pull {self.ref.name}{extra}"

    def resolve(self, refresh: bool = False) -> ResolvedModel:
        """The local model: the path itself, the cached snapshot, or a fresh download (``refresh``:
        ask the Hub for its latest files even on a cache hit, as ``llmserve pull`` does)."""
        if self.ref is None or self.hub is None:
            return ResolvedModel(self.text, self.text)
        found, fetched = self.cached, False
        if found is None or (refresh and not self.offline):
            if self.offline:
                raise ConfigError(self.miss_message())
            found, fetched = fetch(self.hub, self.ref, self.revision, self.mmproj), True
        folder, selection = found
        mark_used(folder, selection.files)
        path = f"{folder}/{selection.serve}" if selection.serve else folder
        if not fetched:
            log.info("%s found in the Hugging Face cache: %s", self.ref.name, path)
        return ResolvedModel(path, self.ref.name, self.ref, folder, selection, fetched)

    def miss_message(self) -> str:
        assert self.ref is not None and self.hub is not None
        why = "--offline" if not env_offline() else "HF_HUB_OFFLINE=1"
        return (f"{self.ref.name} is not in the local Hugging Face cache ({self.hub.cache}) and {why} forbids "
                f"downloads: fetch it first with `{self.pull_command()}`")


def plan_model(text: str, *, revision: str | None = None, offline: bool = False, token: str | None = None,
               mmproj: bool = False, need_cache: bool = True) -> ModelSource:
    """Look ``text`` up without the network: a local path, or a repo id with its cache hit (if
    any). Offline, a miss is the one-line ``ConfigError`` that names ``llmserve pull``
    (``need_cache=False``: leave that to ``resolve``)."""
    ref = classify(text)
    if ref is None:
        return ModelSource(text)
    offline = offline or env_offline()
    hub = Hub.from_env(hub_cache_dir(), token)
    source = ModelSource(text, ref, check_revision(revision), offline, mmproj, hub)
    source.cached = cached_selection(hub.cache, ref, source.revision, mmproj)
    if source.cached is None and offline and need_cache:
        raise ConfigError(source.miss_message())
    if source.cached is not None:
        for note in source.cached[1].notes:
            log.info("%s", note)
    return source


def plan_config_model(llm: ModelConfig) -> ModelSource | None:
    """``plan_model`` for the model section's ``model`` (None: the backend's default model). A
    GGUF repo's vision projector comes with a fresh download (the model reads images with it); a
    cached copy without one is served as it is."""
    if llm.model is None:
        return None
    return plan_model(str(llm.model), revision=llm.revision, offline=llm.offline, token=llm.hf_token, mmproj=True)


def apply_resolved(llm: ModelConfig, resolved: ResolvedModel) -> None:
    """Point the model section at the local files; a Hub model is served under its id (unless
    ``--served-model-name`` names it)."""
    if resolved.ref is None:
        return
    llm.model = resolved.path
    if not llm.served_model_name:
        llm.served_model_name = [resolved.name]


def resolve_model(text: str, *, revision: str | None = None, offline: bool = False, token: str | None = None,
                  mmproj: bool = False) -> ResolvedModel:
    """``plan_model`` then ``resolve``: the local model ``text`` names, fetched if need be."""
    return plan_model(text, revision=revision, offline=offline, token=token, mmproj=mmproj).resolve()
