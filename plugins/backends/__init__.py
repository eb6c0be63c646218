"""Built-in backend (model runner) plugins."""
