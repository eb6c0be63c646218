"""Content negotiation between routes: one method and path, answered by the route whose media type
the request's ``Accept`` header prefers (a browser's ``GET /`` gets a page, a client's the API).

A dialect marks such a route with ``answers_media("text/html")``. ``build_app`` lets it share its
method and path with one unmarked route (the answer for every other request) and tries it first;
the router (``DialectRoute.matches``) and the request guard (``Checks.match``) skip it unless the
request prefers its media type, so the API key rules of the route that answers are the ones applied.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from starlette.types import Scope

F = TypeVar("F", bound=Callable[..., Any])

MEDIA_ATTR = "__llmserve_media__"


def answers_media(media_type: str) -> Callable[[F], F]:
    """Mark an endpoint as the answer for the requests that prefer ``media_type`` (see the module)."""

    def mark(endpoint: F) -> F:
        setattr(endpoint, MEDIA_ATTR, media_type.lower())
        return endpoint

    return mark


def media_of(endpoint: Any) -> str | None:
    """The media type ``endpoint`` is marked with, or None for a route that answers every request."""
    return getattr(endpoint, MEDIA_ATTR, None)


def prefers(accept: str, media_type: str) -> bool:
    """Whether an ``Accept`` header asks for ``media_type`` first: named (or its ``type/*``) with a
    quality no lower than any other type it names. ``*/*`` alone (curl, most SDKs) asks for nothing
    in particular, so it prefers no negotiated route."""
    family = media_type.split("/", 1)[0] + "/*"
    best = mine = 0.0
    for part in accept.lower().split(","):
        name, *params = part.split(";")
        name = name.strip()
        if not name or name == "*/*":
            continue
        quality = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip() == "q":
                try:
                    quality = float(value)
                except ValueError:
                    quality = 0.0
        best = max(best, quality)
        if name in (media_type, family):
            mine = max(mine, quality)
    return mine > 0 and mine >= best


def wanted(scope: Scope, endpoint: Any) -> bool:
    """Whether the route of ``endpoint`` may answer ``scope``: always, unless it is negotiated and the
    request does not prefer its media type."""
    media = media_of(endpoint)
    if media is None:
        return True
    accept = next((v for k, v in scope.get("headers", ()) if k == b"accept"), b"")
    return prefers(accept.decode("latin-1"), media)
