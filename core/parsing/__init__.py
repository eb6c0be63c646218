"""Parsing model output: the parser contract, the streaming toolkit, JSON scanning, the parse chain and tool-choice planning."""
