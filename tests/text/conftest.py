"""Fixtures of the text tests: the embedded SmolLM2 tokenizer, shared with the parser tests."""

from parsers.conftest import smollm_tokenizer

__all__ = ["smollm_tokenizer"]
