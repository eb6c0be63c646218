"""The base of every settings section (its own module so that sections in other modules can
derive from it without importing the rest)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A group of settings; its field names are the settings' own (flat) names."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())
