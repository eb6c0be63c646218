"""Reading the shell examples of README.md and docs/ and judging their output: the parser and
the comparisons behind tests/test_docs_examples.py (which runs them)."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL = {"sh", "bash", "console", "shell"}
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                   re.M | re.S)
NOT_RUN = re.compile(r"<!--\s*not-run:(?P<reason>.*?)-->", re.S)
DEFINES = re.compile(r"#\s*(?P<name>[\w.-]+\.(?:ya?ml|py|json|toml|jinja))\s*(?::.*)?")


@dataclass
class Block:
    doc: Path
    line: int
    lang: str
    body: str
    not_run: str | None = None
    shown_json: str | None = None  # a ```json block right after this one: its output
    defines: str | None = None  # a file this (non-shell) block writes


@dataclass
class Step:
    command: str
    expected: str | None
    line: int
    block: Block
    serve: list[str] | None = None  # the arguments of `llmserve serve`
    env: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.block.doc.relative_to(ROOT)}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    text = doc.read_text()
    found = list(FENCE.finditer(text))
    result = []
    for i, match in enumerate(found):
        indent, lang = match.group("indent"), match.group("lang")
        body = "\n".join(line[len(indent):] if line.startswith(indent) else line.lstrip()
                         for line in match.group("body").splitlines())
        line = text.count("\n", 0, match.start()) + 1
        if lang == "text" and body.startswith("$ "):
            lang = "console"  # a transcript shown as plain text (a long --help) is run all the same
        if lang not in SHELL:
            first = body.splitlines()[0].strip() if body.strip() else ""
            if defined := DEFINES.fullmatch(first):
                result.append(Block(doc, line, lang, body, defines=defined.group("name")))
            continue
        block = Block(doc, line, lang, body)
        for above in reversed(text[:match.start()].rstrip().splitlines()):
            above = above.strip()
            if (marker := NOT_RUN.fullmatch(above)) is not None:
                block.not_run = marker.group("reason").strip()
                break
            if not (above.startswith("<!--") and above.endswith("-->")):
                break
        nxt = found[i + 1] if i + 1 < len(found) else None
        if nxt is not None and nxt.group("lang") == "json" and not text[match.end():nxt.start()].strip():
            block.shown_json = nxt.group("body")
        result.append(block)
    return result


def incomplete(command: str) -> bool:
    if command.rstrip().endswith("\\"):
        return True
    try:
        shlex.split(command, comments=True)
    except ValueError:  # an open quote: the command goes on
        return True
    return False


def split_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, _, value = words[0].partition("=")
        env[name] = value
        words = words[1:]
    return env, words


def steps(block: Block) -> list[Step]:
    lines, console, result, i = block.body.splitlines(), block.lang == "console", [], 0
    while i < len(lines):
        line, start = lines[i], i
        if console and not line.startswith("$ "):
            i += 1
            continue
        if not console and (not line.strip() or line.strip().startswith("#")):
            i += 1
            continue
        command = line[2:] if console else line
        while incomplete(command) and i + 1 < len(lines):
            i += 1
            command += "\n" + lines[i]
        i += 1
        expected = None
        if console:
            shown = []
            while i < len(lines) and not lines[i].startswith("$ "):
                shown.append(lines[i])
                i += 1
            expected = "\n".join(shown).strip("\n")
        step = Step(command, expected or None, block.line + 1 + start, block)
        env, words = split_env(shlex.split(command.replace("\\\n", " "), comments=True))
        if words[:2] == ["llmserve", "serve"] and not {"|", "--help", "-h"} & set(words):
            step.env, step.serve = env, [w for w in words[2:] if w != "&"]
        result.append(step)
    if block.shown_json is not None and result and result[-1].expected is None:
        result[-1].expected = block.shown_json.strip()
    return result


def all_blocks() -> list[Block]:
    return [b for doc in DOCS for b in blocks(doc)]


# ---- comparing outputs ----------------------------------------------------------------------

def squash(text: str) -> list[str]:
    lines = [re.sub(r"\s+", " ", line).strip() for line in text.strip("\n").splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def text_matches(expected: str, actual: str) -> bool:
    """Line by line, runs of blank space as one; ``...`` matches any text, a line of ``...``
    any lines."""
    pattern = []
    for line in squash(expected):
        if line == "...":
            pattern.append(r"(?:[^\n]*\n)*?")
        else:
            pattern.append(".*?".join(re.escape(part) for part in line.split("...")) + r"\n")
    return re.fullmatch("".join(pattern), "\n".join(squash(actual)) + "\n", flags=re.S) is not None


def units(text: str) -> list[str]:
    """A reply as JSON documents: the whole text, else its lines (NDJSON, SSE `data:` events)."""
    try:
        json.loads(text)
        return [text]
    except ValueError:
        pass
    out = []
    for line in text.replace("\0", "\n").splitlines():
        line = line.strip()
        if line.startswith("data:"):
            line = line[5:].strip()
        if line and not line.startswith((":", "event:", "id:", "retry:")):
            out.append(line)
    return out


def loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def keys(value) -> set[str]:
    if isinstance(value, dict):
        return set(value).union(*(keys(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(keys(v) for v in value))
    return set()


def shape_error(expected, actual, path: str = "$") -> str | None:
    """Where ``actual`` lacks a key of ``expected`` or has another type of value (null is any)."""
    if expected is None or actual is None:
        return None
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return f"{path}: expected an object, got {json.dumps(actual)[:80]}"
        for key, value in expected.items():
            if key not in actual:
                return f"{path}: no key {key!r} (has {sorted(actual)})"
            if (error := shape_error(value, actual[key], f"{path}.{key}")) is not None:
                return error
        return None
    if isinstance(expected, list):
        if not isinstance(actual, list):
            return f"{path}: expected a list, got {json.dumps(actual)[:80]}"
        if expected and actual:
            return shape_error(expected[0], actual[0], f"{path}[0]")
        return None
    number = (int, float)
    same = (isinstance(expected, number) and isinstance(actual, number) and not isinstance(actual, bool)
            and not isinstance(expected, bool)) or type(expected) is type(actual)
    return None if same else f"{path}: expected a {type(expected).__name__}, got {json.dumps(actual)[:80]}"


def reply_error(expected: str, actual: str) -> str | None:
    """A server's reply against the doc's: HTTP status line and header names for `curl -i`,
    else JSON shape."""
    if expected.startswith("HTTP/"):
        head_e, _, body_e = expected.partition("\n\n")
        head_a, _, body_a = actual.replace("\r\n", "\n").partition("\n\n")
        if head_e.splitlines()[0].split()[1] != head_a.splitlines()[0].split()[1]:
            return f"status {head_a.splitlines()[0]!r}, the doc shows {head_e.splitlines()[0]!r}"
        names = {line.split(":")[0].lower() for line in head_a.splitlines()[1:]}
        missing = {line.split(":")[0].lower() for line in head_e.splitlines()[1:]} - names
        if missing:
            return f"headers {sorted(missing)} missing"
        return reply_error(body_e, body_a) if body_e.strip() else None
    got = [loads(u) for u in units(actual) if u != "[DONE]"]
    if not got or any(g is None for g in got):
        return f"the reply is not JSON: {actual[:200]!r}"
    for unit in units(expected):
        if unit == "[DONE]":
            continue
        want = loads(unit)
        if want is not None:
            errors = [shape_error(want, g) for g in got]
            if all(errors):
                return errors[0]
        else:  # abbreviated with "...": the keys it names must be in the reply
            named = set(re.findall(r'"([^"]+)"\s*:', unit))
            lacking = named - set().union(*(keys(g) for g in got))
            if lacking:
                return f"the reply lacks keys {sorted(lacking)}"
    if "[DONE]" in expected and "[DONE]" not in actual:
        return "the stream did not end with [DONE]"
    return None


def log_matches(expected: str, log: str) -> str | None:
    def norm(line: str) -> str:
        line = re.sub(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ", "", line.strip())
        line = re.sub(r"\[\d+\]", "[N]", line)
        return re.sub(r"\d+(\.\d+)? s\b", "N s", re.sub(r"\s+", " ", line))

    have = [norm(line) for line in log.splitlines()]
    for want in filter(None, (norm(line) for line in expected.splitlines())):
        pattern = ".*?".join(re.escape(part) for part in want.split("..."))
        if not any(re.fullmatch(pattern, line) for line in have):
            return f"the server's log has no line {want!r}"
    return None


