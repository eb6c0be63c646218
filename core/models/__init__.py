"""Models by name: a ``MODEL`` value resolved to local files (a path, the Hugging Face cache, or a
download into it), and the cache that ``llmserve pull`` / ``ls`` / ``rm`` manage.

``ref.py`` (what a value names: a path or ``org/name[:QUANT]``, checked strictly), ``select.py``
(which files of a repo to fetch and serve), ``cache.py`` (the local cache: lookup, listing,
deletion), ``hub.py`` (fetching through huggingface_hub, with progress and one-line errors),
``resolve.py`` (the order: path, cache, download; what the server and the CLI call).
"""

from llmserve.models.ref import ModelRef, parse_ref
from llmserve.models.resolve import ModelSource, ResolvedModel, plan_model, resolve_model

__all__ = ["ModelRef", "ModelSource", "ResolvedModel", "parse_ref", "plan_model", "resolve_model"]
