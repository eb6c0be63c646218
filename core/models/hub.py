"""Fetching a repo's selected files from the Hugging Face Hub into the standard cache, through
``huggingface_hub`` (imported here, lazily: ``import llmserve`` never pulls it in).

One file at a time, each a progress phase in bytes (a live bar on a terminal, a log line per file
and a periodic percentage elsewhere: ``llmserve.progress``); a file already in the cache is not
fetched again, and a transfer cut mid-file is resumed by huggingface_hub with a ranged request.
Every failure the user can act on (no access, no such repo or revision, no network, a full disk)
is one ``ConfigError`` line.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from llmserve import progress
from llmserve.errors import ConfigError
from llmserve.models.ref import ModelRef
from llmserve.models.select import Selection, select_files

log = logging.getLogger("llmserve.models")
DEFAULT_ENDPOINT = "https://huggingface.co"


@dataclass
class Hub:
    """Where the Hub and the cache are, and the token (None: huggingface_hub's own, ``HF_TOKEN``)."""

    cache: str
    token: str | None = None
    endpoint: str = DEFAULT_ENDPOINT

    @classmethod
    def from_env(cls, cache: str, token: str | None = None) -> "Hub":
        return cls(cache, token or None, (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/"))

    def page(self, repo: str) -> str:
        return f"{self.endpoint}/{repo}"


class _FileBar:
    """The tqdm-shaped object huggingface_hub drives while it downloads one file: it moves the
    file's progress phase (opened by ``fetch``) instead of drawing anything."""

    phase: progress.Phase | None = None

    def __init__(self, *args: Any, initial: int | float = 0, **kwargs: Any) -> None:
        if self.phase is not None:
            self.phase.done = int(initial or 0)

    def __enter__(self) -> "_FileBar":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int | float | None = 1) -> None:
        if self.phase is not None:
            self.phase.done += int(n or 0)

    def close(self) -> None:
        return None

    def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
        return None

    refresh = set_description = set_postfix = update_transfer = set_transfer_postfix_str = set_postfix_str


def _megabytes(n: int | None) -> str:
    return "size unknown" if n is None else f"{n / 1e6:.1f} MB"


def describe_error(exc: BaseException, hub: Hub, ref: ModelRef, revision: str | None, what: str = "") -> ConfigError:
    """What huggingface_hub (or the network under it) raised, as one line naming the fix."""
    from huggingface_hub import errors

    status = getattr(getattr(exc, "response", None), "status_code", None)
    page = hub.page(ref.repo)
    if status == 403:  # a token was sent, and its account has not been granted the gated repo
        return ConfigError(f"{ref.repo} is gated and the token sent has not been granted access (HTTP 403): request "
                           f"access at {page} with the account the token belongs to, or pass another token with "
                           "--hf-token or HF_TOKEN")
    if isinstance(exc, errors.GatedRepoError) or status == 401:
        return ConfigError(f"{ref.repo} is gated or private and this request has no access (HTTP {status}): request "
                           f"access at {page} and pass a token with --hf-token or HF_TOKEN")
    if isinstance(exc, errors.RevisionNotFoundError):
        return ConfigError(f"{ref.repo} has no revision {revision!r} on {hub.endpoint}: check --revision")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return ConfigError(f"no model repo {ref.repo} on {hub.endpoint}: check the id at {page}")
    if isinstance(exc, errors.EntryNotFoundError):
        return ConfigError(f"{ref.repo} lists {what or 'a file'} but the Hub does not serve it (HTTP {status}); "
                           "retry later")
    if isinstance(exc, errors.OfflineModeIsEnabled):
        return ConfigError(f"{ref.name} is not in the local Hugging Face cache and offline mode is on "
                           f"(HF_HUB_OFFLINE): fetch it with `llmserve pull {ref.name}` while online")
    if isinstance(exc, errors.HfHubHTTPError):
        about = f"{ref.repo} {what}".strip()
        return ConfigError(f"the Hub at {hub.endpoint} answered HTTP {status} for {about}; retry later")
    if isinstance(exc, OSError) and getattr(exc, "errno", None) is not None:
        return ConfigError(f"cannot write {ref.name} into the Hugging Face cache {hub.cache}: {exc.strerror or exc}")
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    cause = exc.__cause__ or exc.__context__
    if cause is not None and type(exc).__name__ == "LocalEntryNotFoundError":
        text = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    return ConfigError(f"cannot fetch {ref.name}{' (' + what + ')' if what else ''} from {hub.endpoint}: "
                       f"{type(cause or exc).__name__}: {text[:200]}; check the network, or serve a cached model")


def _quiet_http() -> None:
    """No log line per HTTP request of the HTTP clients under huggingface_hub (their INFO level)."""
    for name in ("httpx", "httpx2"):
        logger = logging.getLogger(name)
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))


def list_repo(hub: Hub, ref: ModelRef, revision: str | None) -> tuple[str, dict[str, int | None]]:
    """(commit, file -> size) of ``ref`` at ``revision`` on the Hub."""
    from huggingface_hub import HfApi

    _quiet_http()

    try:
        info = HfApi(endpoint=hub.endpoint, token=hub.token).model_info(ref.repo, revision=revision,
                                                                         files_metadata=True)
    except Exception as exc:  # every failure becomes one line (the chain is never printed)
        raise describe_error(exc, hub, ref, revision) from exc
    if not info.sha:
        raise ConfigError(f"the Hub at {hub.endpoint} gave no commit for {ref.repo}; retry later")
    return str(info.sha), {s.rfilename: s.size for s in info.siblings or []}


def _write_ref(hub: Hub, ref: ModelRef, revision: str, commit: str) -> None:
    """Record ``revision -> commit`` under the repo's ``refs/`` as huggingface_hub does, so a later
    offline start finds the snapshot by its branch or tag."""
    if revision == commit:
        return
    path = os.path.join(hub.cache, ref.cache_folder, "refs", *revision.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(commit)
    os.replace(tmp, path)


def fetch(hub: Hub, ref: ModelRef, revision: str | None, mmproj: bool = False) -> tuple[str, Selection]:
    """Fetch what ``ref`` needs into the cache; return (snapshot folder, selection)."""
    from huggingface_hub import hf_hub_download

    commit, sizes = list_repo(hub, ref, revision)
    selection = select_files(ref, list(sizes), mmproj)
    for note in selection.notes:
        log.info("%s", note)
    total = sum(sizes.get(f) or 0 for f in selection.files)
    log.info("fetching %s (%s) from %s into %s: %d files, %s", ref.name, commit[:12], hub.endpoint, hub.cache,
             len(selection.files), _megabytes(total))
    folder = os.path.join(hub.cache, ref.cache_folder, "snapshots", commit)
    for number, name in enumerate(selection.files, 1):
        if os.path.isfile(os.path.join(folder, name)):
            continue
        size = sizes.get(name)
        log.info("fetching %s: %s (%s), file %d of %d", ref.repo, name, _megabytes(size), number,
                 len(selection.files))
        with progress.phase(f"fetching {ref.repo} {name}", total=size or None, unit="B") as phase:
            bar = type("FileBar", (_FileBar,), {"phase": phase})
            try:
                hf_hub_download(ref.repo, name, revision=commit, cache_dir=hub.cache, endpoint=hub.endpoint,
                                token=hub.token, tqdm_class=bar)
            except Exception as exc:  # every failure becomes one line (the chain is never printed)
                raise describe_error(exc, hub, ref, revision, name) from exc
    _write_ref(hub, ref, revision or "main", commit)
    log.info("fetched %s: %d files, %s, in %s", ref.name, len(selection.files), _megabytes(total), folder)
    return folder, selection
