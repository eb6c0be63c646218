"""Tests for llmserve.text."""
