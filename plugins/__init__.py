"""llmserve's built-in plugins. They register through the ``llmserve`` entry-point group exactly
like third-party packages do; the core never imports them by name."""
