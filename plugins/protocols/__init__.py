"""Built-in protocol (dialect) plugins, one package per dialect."""
