"""Finding, loading and blocking plugins (pluggy + the ``llmserve`` entry-point group).

Loading order: built-ins (entry points of the llmserve distribution), other entry points
(unless ``LLMSERVE_DISABLE_PLUGIN_AUTOLOAD=1``), the YAML ``plugins:`` list, then each
``--plugin SPEC``. A SPEC is ``pkg.mod``, ``pkg.mod:attr``, ``path/to/file.py``, an
entry-point name, or ``no:NAME`` to block one.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import pluggy

from llmserve.hooks import specs as hookspecs
from llmserve.hooks.records import resolve
from llmserve.errors import PluginLoadError

log = logging.getLogger("llmserve.plugins")

GROUP = "llmserve"
AUTOLOAD_ENV = "LLMSERVE_DISABLE_PLUGIN_AUTOLOAD"
SELF_DIST = "llmserve"


@dataclass
class PluginInfo:
    """One registered (or failed) plugin, as ``llmserve plugins`` shows it."""

    name: str
    source: str                      # builtin | entrypoint | config | cli
    module: str | None = None
    distribution: str | None = None
    version: str | None = None
    error: str | None = None
    contributes: dict[str, list[str]] = field(default_factory=dict)


def _entry_points() -> list[md.EntryPoint]:
    seen: set[tuple[str, str]] = set()
    out = []
    for ep in md.entry_points(group=GROUP):
        key = (ep.name, ep.value)
        if key not in seen:  # the same distribution can be visible twice (editable + regular)
            seen.add(key)
            out.append(ep)
    return out


def _dist_of(module_name: str) -> tuple[str | None, str | None]:
    top = module_name.split(".")[0]
    for dist in md.packages_distributions().get(top, []):
        try:
            return dist, md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None, None


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class PluginManager:
    """A pluggy manager that knows where each plugin came from."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(GROUP)
        self.pm.add_hookspecs(hookspecs)
        self.infos: dict[str, PluginInfo] = {}
        self.blocked: set[str] = set()

    # -- loading -----------------------------------------------------------------------------
    def load(self, specs: Sequence[tuple[str, str]] = (), autoload: bool | None = None) -> "PluginManager":
        """Load built-ins, entry points and explicit ``(spec, source)`` pairs, in that order."""
        explicit = []
        for spec, source in specs:
            if spec.startswith("no:"):
                self.block(spec[3:])
            else:
                explicit.append((spec, source))
        if autoload is None:
            autoload = os.environ.get(AUTOLOAD_ENV, "").strip().lower() not in ("1", "true", "yes")
        eps = _entry_points()
        for ep in eps:
            if ep.dist is not None and ep.dist.name == SELF_DIST:
                self._load_entry_point(ep, "builtin", explicit=False)
        if autoload:
            for ep in eps:
                if ep.dist is None or ep.dist.name != SELF_DIST:
                    self._load_entry_point(ep, "entrypoint", explicit=False)
        for spec, source in explicit:
            self.load_spec(spec, source)
        self.check()
        return self

    def check(self) -> None:
        """Fail on hook functions that match no hookspec (a typo would otherwise be ignored)."""
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            name = self.pm.get_name(exc.plugin) or "?"
            raise PluginLoadError(f"plugin '{name}': {str(exc).splitlines()[0]}") from None

    def block(self, name: str) -> None:
        """Block a plugin by name; unregister it if it is already loaded."""
        self.blocked.add(name)
        if self.pm.get_plugin(name) is not None:
            self.pm.unregister(name=name)
            self.infos.pop(name, None)

    def load_spec(self, spec: str, source: str = "cli") -> None:
        """Load one plugin the user asked for; any failure raises PluginLoadError."""
        if spec.startswith("no:"):
            self.block(spec[3:])
            return
        try:
            if spec.endswith(".py") or os.sep in spec or spec.startswith("."):
                self._load_file(Path(spec), source)
                return
            for ep in _entry_points():
                if ep.name == spec:
                    self._load_entry_point(ep, source, explicit=True)
                    return
            if ":" in spec:
                self._register(resolve(spec), spec.replace(":", "."), source, spec.split(":")[0])
            else:
                self._register(importlib.import_module(spec), spec, source, spec)
        except PluginLoadError:
            raise
        except BaseException as exc:  # noqa: BLE001 - report any import-time failure as one line
            raise PluginLoadError(f"cannot load plugin '{spec}': {_describe(exc)}") from None

    def _load_file(self, path: Path, source: str) -> None:
        if not path.is_file():
            raise PluginLoadError(f"cannot load plugin '{path}': no such file")
        name = path.stem
        if name in self.blocked or self.pm.get_plugin(name) is not None:
            return
        mod_name = f"llmserve_plugin_{name}"
        spec = importlib.util.spec_from_file_location(mod_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(mod_name, None)
            raise
        self._register(module, name, source, None)

    def _load_entry_point(self, ep: md.EntryPoint, source: str, explicit: bool) -> None:
        if ep.name in self.blocked or self.pm.get_plugin(ep.name) is not None:
            return
        dist = ep.dist.name if ep.dist else None
        version = ep.dist.version if ep.dist else None
        try:
            obj = ep.load()
        except BaseException as exc:  # noqa: BLE001 - a broken plugin is one warning line, not a crash
            msg = f"plugin '{ep.name}' ({ep.value}) failed to load: {_describe(exc)}"
            if explicit:
                raise PluginLoadError(msg) from None
            log.warning("%s; skipping it", msg)
            self.infos[ep.name] = PluginInfo(ep.name, source, ep.value, dist, version, error=_describe(exc))
            return
        self._register(obj, ep.name, source, ep.value.split(":")[0], dist, version)

    def _register(self, obj: Any, name: str, source: str, module: str | None,
                  dist: str | None = None, version: str | None = None) -> None:
        if name in self.blocked or self.pm.get_plugin(name) is not None:
            return
        if self.pm.is_registered(obj):
            return  # the same module reached through two specs
        if dist is None and module:
            dist, version = _dist_of(module)
        self.pm.register(obj, name=name)
        self.infos[name] = PluginInfo(name, source, module, dist, version)

    # -- queries -----------------------------------------------------------------------------
    @property
    def hook(self) -> Any:
        return self.pm.hook

    def impls(self, hook_name: str) -> list[tuple[str, Any]]:
        """``(plugin name, hook function)`` for every implementation, in registration order."""
        caller = getattr(self.pm.hook, hook_name)
        return [(impl.plugin_name, impl.function) for impl in caller.get_hookimpls()]
