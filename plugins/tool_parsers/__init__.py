"""Built-in tool-call and reasoning parser plugins."""
