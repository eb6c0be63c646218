"""Parsing model output: the parser contract, the streaming toolkit, JSON scanning, the parse
chain and its factory, tool-choice planning and the forced-output parsers."""
