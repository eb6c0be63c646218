"""The command-line options the benchmark scripts share, written once so they keep one name,
default and meaning in every script (the scripts import it by name: a script's folder is first
on ``sys.path`` when it runs)."""

from __future__ import annotations

import argparse


def new_parser(doc: str | None) -> argparse.ArgumentParser:
    """A script's parser, its module doc as the description (layout kept)."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_model(ap: argparse.ArgumentParser) -> None:
    """Which model llmserve loads, in which dtype, on which device."""
    ap.add_argument("--model", default=None, help="HF dir or .gguf (default: the embedded SmolLM2)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")


def add_levels(ap: argparse.ArgumentParser, rounds: bool = True) -> None:
    """The concurrency levels; with ``rounds``, the requests, tokens and rounds of each level of
    a closed-loop run against servers."""
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    if not rounds:
        return
    ap.add_argument("--requests-per-level", type=int, default=0, help="default: 2 x concurrency")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each level per server, alternating the order")


def add_outputs(ap: argparse.ArgumentParser, markdown_help: str) -> None:
    """Where the servers' logs and the results go."""
    ap.add_argument("--log-dir", default="bench/logs")
    ap.add_argument("--markdown", default=None, help=markdown_help)
    ap.add_argument("--json", default=None, help="write raw results as JSON")
