"""The HTTP server: app assembly, error mapping, shared context and the serve entry point."""
