"""Load generation against OpenAI-compatible servers: the engine of ``llmserve bench serve`` and bench/."""
