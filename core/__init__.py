"""llmserve: a plugin-based LLM serving framework.

Importing this package is deliberately cheap: no torch, no transformers, no FastAPI.
Heavy modules are imported only by the code paths that need them. Plugins mark their hook
functions with ``llmserve.hookimpl``.
"""

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("llmserve")

__all__ = ["__version__", "hookimpl"]
