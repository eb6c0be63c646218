"""The contributions of all loaded plugins, indexed by kind and name, with the duplicate rule."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmserve.hooks.records import Contribution
from llmserve.errors import ConfigError, PluginLoadError
from llmserve.hooks.manager import PluginManager

HOOKS = {
    "protocol": "register_protocols",
    "backend": "register_backends",
    "tool_parser": "register_tool_parsers",
    "reasoning_parser": "register_reasoning_parsers",
    "guided_decoder": "register_guided_decoders",
    "proposer": "register_proposers",
}
LABELS = {"protocol": "protocol", "backend": "backend", "tool_parser": "tool parser",
          "reasoning_parser": "reasoning parser", "guided_decoder": "guided decoder", "proposer": "proposer"}


@dataclass
class Entry:
    record: Contribution
    plugin: str


@dataclass
class Registry:
    """``kinds[kind][name] -> Entry``; aliases point at the same entry."""

    kinds: dict[str, dict[str, Entry]] = field(default_factory=lambda: {k: {} for k in HOOKS})

    @classmethod
    def collect(cls, plugins: PluginManager) -> "Registry":
        reg = cls()
        for kind, hook_name in HOOKS.items():
            for plugin_name, fn in plugins.impls(hook_name):
                result = fn()
                records = [result] if isinstance(result, Contribution) else list(result or [])
                for record in records:
                    reg._add(kind, Entry(record, plugin_name))
                    info = plugins.infos.get(plugin_name)
                    names = info.contributes.setdefault(kind, []) if info is not None else []
                    if record.name not in names:  # collecting twice (the CLI does) lists a name once
                        names.append(record.name)
        return reg

    def _add(self, kind: str, entry: Entry) -> None:
        table = self.kinds[kind]
        names = [entry.record.name, *getattr(entry.record, "aliases", ())]
        for name in names:
            old = table.get(name)
            if old is None or old.record is entry.record:
                table[name] = entry
            elif entry.record.overrides and not old.record.overrides:
                table[name] = entry
            elif old.record.overrides and not entry.record.overrides:
                continue
            else:
                raise PluginLoadError(
                    f"{LABELS[kind]} '{name}' is contributed by both plugin '{old.plugin}' and plugin "
                    f"'{entry.plugin}'; set overrides=True on the one that should win, or block the "
                    f"other with --plugin no:{entry.plugin}"
                )

    def names(self, kind: str) -> list[str]:
        """Primary names (no aliases), sorted."""
        return sorted({e.record.name for e in self.kinds[kind].values()})

    def get(self, kind: str, name: str) -> Entry:
        try:
            return self.kinds[kind][name]
        except KeyError:
            valid = ", ".join(self.names(kind)) or "none installed"
            raise ConfigError(f"unknown {LABELS[kind]} '{name}'; available: {valid}") from None

    def load(self, kind: str, name: str) -> Any:
        """Import the implementation behind ``name``; import errors become one clear line."""
        entry = self.get(kind, name)
        try:
            return entry.record.load()
        except Exception as exc:  # noqa: BLE001 - any import failure becomes one clear line
            raise PluginLoadError(
                f"{LABELS[kind]} '{name}' from plugin '{entry.plugin}' failed to import "
                f"{entry.record.target}: {type(exc).__name__}: {exc}"
            ) from None

    def records(self) -> list[tuple[str, Entry]]:
        """Every distinct record as ``(kind, entry)``."""
        out, seen = [], set()
        for kind, table in self.kinds.items():
            for entry in table.values():
                if id(entry.record) not in seen:
                    seen.add(id(entry.record))
                    out.append((kind, entry))
        return out
