"""Prompts for the load generator (built-in, random, or a JSONL file) and the request bodies
they become for ``/v1/completions`` or ``/v1/chat/completions``."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "List some tips for learning a new programming language quickly and effectively.",
    "What are the main differences between classical and operant conditioning?",
    "Describe the water cycle in detail, including evaporation, condensation and precipitation.",
    "Give me a recipe for a simple vegetable soup.",
    "Why is the sky blue? Answer in a few paragraphs.",
    "Summarize the plot of a heist movie you invent on the spot.",
]

# Short common words, one token each in the usual BPE vocabularies: a random prompt of N words
# is close to N tokens without a tokenizer on the client (the server's usage has the count).
_WORDS = ("the of and to in is that it for on with as was at by be this from or have an they which one you "
          "had not but what all were when we there can more if out so up said about into than them some "
          "time could these two may first then do any like my now over such our man me even most made after "
          "also did many before must through back years where much your way well down should because each "
          "just those people how too little state good very make world still own see men work long get "
          "here between both life being under never day same another know while last might us great old "
          "year off come since against go came right used take three").split()

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


class DatasetError(ValueError):
    """A dataset file or option that cannot be used; the message names the line or the option."""


@dataclass
class Prompt:
    """One prompt: text (completions) or messages (chat), and its own output length if it has one."""

    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int | None = None


def random_prompts(count: int, input_len: int, rng: random.Random) -> list[Prompt]:
    """``count`` prompts of ``input_len`` random common words each."""
    return [Prompt(" ".join(rng.choice(_WORDS) for _ in range(max(1, input_len)))) for _ in range(count)]


def builtin_prompts(count: int) -> list[Prompt]:
    """``count`` prompts cycling through the built-in ones."""
    return [Prompt(PROMPTS[i % len(PROMPTS)]) for i in range(count)]


def _line_prompt(value: Any, where: str) -> Prompt:
    if isinstance(value, str):
        return Prompt(value)
    if not isinstance(value, dict):
        raise DatasetError(f"{where}: expected a JSON object or string")
    max_tokens = value.get("max_tokens", value.get("output_len"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise DatasetError(f"{where}: max_tokens must be a positive integer")
    messages = value.get("messages")
    if messages is not None:
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise DatasetError(f"{where}: messages must be a non-empty list of objects")
        return Prompt(messages=messages, max_tokens=max_tokens)
    text = value.get("prompt", value.get("text"))
    if not isinstance(text, str):
        raise DatasetError(f'{where}: needs "prompt" (a string) or "messages" (a list)')
    return Prompt(text, max_tokens=max_tokens)


def jsonl_prompts(path: Path) -> list[Prompt]:
    """Every prompt of a JSONL file: per line a string, or an object with ``prompt`` (or
    ``text``) or ``messages``, and optionally ``max_tokens`` (or ``output_len``)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {exc.strerror or exc}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError:
            raise DatasetError(f"{path}:{number}: not valid JSON") from None
        prompts.append(_line_prompt(value, f"{path}:{number}"))
    if not prompts:
        raise DatasetError(f"{path}: no prompts")
    return prompts


def sample_prompts(prompts: list[Prompt], count: int, rng: random.Random, shuffle: bool) -> list[Prompt]:
    """``count`` prompts from a file's: in file order (cycling), or shuffled with ``rng``."""
    order = list(range(len(prompts)))
    if shuffle:
        rng.shuffle(order)
    return [prompts[order[i % len(order)]] for i in range(count)]


def request_body(prompt: Prompt, endpoint: str, model: str, max_tokens: int, *, temperature: float,
                 ignore_eos: bool, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The streaming request body for ``endpoint``; it asks for usage in the last event."""
    body: dict[str, Any] = {"model": model, "max_tokens": prompt.max_tokens or max_tokens,
                            "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}}
    if endpoint.endswith("/chat/completions"):
        body["messages"] = prompt.messages or [{"role": "user", "content": prompt.text or ""}]
    elif prompt.messages is not None:
        raise DatasetError(f"a prompt with messages needs --endpoint /v1/chat/completions, not {endpoint}")
    else:
        body["prompt"] = prompt.text
    if ignore_eos:
        body["ignore_eos"] = True  # a vLLM extension: every request runs to max_tokens
    body.update(extra or {})
    return body
