"""Talking to a running OpenAI-compatible server from the command line (``llmserve chat`` and
``llmserve bench serve``): base URLs, the API-key header, the model list, and failures turned
into one line that names the URL and the fix.

httpx is imported inside the functions that use it, so importing this module stays cheap.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

# Client-side API key variables: the server's own (so one exported key serves both) and OpenAI's.
API_KEY_ENV = ["LLMSERVE_API_KEY", "OPENAI_API_KEY"]


class RemoteError(Exception):
    """A server that cannot be used as asked; the message is one line that says what to do.
    ``status`` is the HTTP status when the server answered."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def _with_path(url: str, path: str) -> str:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def openai_base(url: str) -> str:
    """The ``.../v1`` base an OpenAI client uses: ``http://host:8000`` and ``http://host:8000/v1/``
    both give ``http://host:8000/v1``."""
    path = urlsplit(url if "://" in url else f"http://{url}").path.rstrip("/")
    return _with_path(url, path if path.endswith("/v1") else f"{path}/v1")


def server_root(url: str) -> str:
    """The server's root, to which paths such as ``/v1/completions`` are appended (a trailing
    ``/v1`` is dropped, so the chat command's ``--url`` works here too)."""
    path = urlsplit(url if "://" in url else f"http://{url}").path.rstrip("/")
    return _with_path(url, path.removesuffix("/v1"))


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def error_message(status: int, body: bytes | str, url: str) -> str:
    """One line for a refused request: 401/403 say how to pass the key; others quote the
    server's own message (OpenAI envelope, vLLM's flat one, or the start of the body)."""
    if status in (401, 403):
        return (f"the server at {url} refused the request (HTTP {status}): pass its key with --api-key KEY "
                f"(or set {API_KEY_ENV[0]})")
    text = body.decode(errors="replace") if isinstance(body, bytes) else body
    message = text.strip()[:300]
    try:
        import json

        data = json.loads(text)
        error = data.get("error", data) if isinstance(data, dict) else data
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            message = error["message"]
        elif isinstance(error, str):
            message = error
    except ValueError:
        pass
    return f"HTTP {status} from {url}: {message}"


def unreachable(url: str, exc: Exception) -> RemoteError:
    reason = str(exc).strip() or type(exc).__name__
    return RemoteError(f"cannot reach a server at {url} ({reason}); start one with `llmserve serve` or pass --url")


def list_models(base_v1: str, api_key: str | None, timeout: float = 10.0) -> list[str]:
    """The ids ``GET {base_v1}/models`` lists; ``RemoteError`` when the server is not reachable
    or refuses."""
    import httpx

    url = f"{base_v1}/models"
    try:
        response = httpx.get(url, headers=auth_headers(api_key), timeout=timeout)
    except httpx.HTTPError as exc:
        raise unreachable(base_v1, exc) from None
    if response.status_code != 200:
        raise RemoteError(error_message(response.status_code, response.content, url), response.status_code)
    try:
        data: Any = response.json()
        return [str(m["id"]) for m in data.get("data", [])]
    except (ValueError, TypeError, KeyError, AttributeError):
        raise RemoteError(f"{url} did not answer an OpenAI model list", response.status_code) from None


def pick_model(base_v1: str, api_key: str | None, model: str | None) -> str:
    """``model`` if given (after checking the server answers), else the server's first model."""
    try:
        models = list_models(base_v1, api_key)
    except RemoteError as exc:
        if model and exc.status is not None and exc.status not in (401, 403):
            return model  # a peer without a model list: the given name is all we need
        raise
    if model:
        return model
    if not models:
        raise RemoteError(f"{base_v1}/models lists no model; pass --model NAME")
    return models[0]
