"""Every registered tool and reasoning parser takes time linear in the model's output, streamed
(in deltas of 1 to 7 characters) and whole, on adversarial output: unclosed ``<tool_call>`` and
``<think>`` tags by the thousand, ``[`` followed by thousands of ``a(``, deep brackets, objects
nested and left open, lists of thousands of elements that are not calls (each one held until
the list has a call), and each parser's own markers repeated or followed by those. The parsers
are read from the registry at run time, so a parser added later is covered too.

A prompt-injected model can be made to write any of these; a parser quadratic in them pins the
server's event loop for minutes per request. The measure is the ratio of the time for 100 kB
to the time for 10 kB: about 10 when linear, about 100 when quadratic; the bound is 15.
"""

from __future__ import annotations

import time
from itertools import cycle

import pytest

from llmserve.parsing.chain import ParseChain

from .helpers import registry

SMALL, BIG = 10_000, 100_000
MAX_RATIO = 15
TOOLS = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": {}}}}]


def repeat(unit: str, size: int) -> str:
    return (unit * (size // len(unit) + 1))[:size]


def generic_inputs() -> dict[str, object]:
    """name -> function of the size giving that much adversarial output."""
    return {
        "unclosed <tool_call>": lambda n: repeat("<tool_call>", n),
        "unclosed <think>": lambda n: repeat("<think>", n),
        "[ then a(": lambda n: "[" + repeat("a(", n - 1),
        "[ nested": lambda n: repeat("[", n),
        "{ nested": lambda n: repeat("{", n),
        "objects nested, open": lambda n: repeat('{"a": ', n),
        "calls nested, open": lambda n: repeat('{"name": "a", "arguments": ', n),
        "lists nested, open": lambda n: repeat("[a(b=", n),
        "list of objects that are not calls": lambda n: "[" + repeat('{"a": 1}, ', n - 1),
        "list of calls that are not valid": lambda n: "[" + repeat("x(1), ", n - 1),
    }


def markers(kind: str, name: str) -> list[str]:
    """The markers a parser class declares (start, lead and end markers, think tags)."""
    cls = registry().load(kind, name)
    found = [*getattr(cls, "start_markers", ()), *getattr(cls, "lead_markers", ()),
             getattr(cls, "end_marker", None), getattr(cls, "start_tag", None), getattr(cls, "end_tag", None)]
    return sorted({m for m in found if isinstance(m, str) and m})


def inputs_for(kind: str, name: str) -> dict[str, object]:
    out = generic_inputs()
    for m in markers(kind, name):
        out[f"{m} repeated"] = lambda n, m=m: repeat(m, n)
        out[f"{m} then [ and a("] = lambda n, m=m: m + "[" + repeat("a(", n - len(m) - 1)
        out[f"{m} then objects nested"] = lambda n, m=m: m + repeat('{"a": ', n - len(m))
        out[f"{m} then words and ["] = lambda n, m=m: m + repeat("x [", n - len(m))
        out[f"{m} then objects that are not calls"] = lambda n, m=m: m + "[" + repeat('{"a": 1}, ', n - len(m) - 1)
    return out


def chains() -> list[tuple[str, str]]:
    reg = registry()
    return ([("tool_parser", n) for n in reg.names("tool_parser")]
            + [("reasoning_parser", n) for n in reg.names("reasoning_parser")])


def run(kind: str, name: str, text: str, streamed: bool) -> float:
    make = {"tool_parser": name} if kind == "tool_parser" else {"reasoning_parser": name}
    chain = ParseChain.create(registry(), tools=TOOLS, **make)
    start = time.perf_counter()
    if streamed:
        pos = 0
        for size in cycle(range(1, 8)):
            if pos >= len(text):
                break
            chain.feed(text[pos:pos + size])
            pos += size
        chain.finish()
        chain.result()
    else:
        chain.parse(text)
    return time.perf_counter() - start


def ratio(kind: str, name: str, build, streamed: bool) -> float:
    """time(100 kB) / time(10 kB). The 10 kB time is that of ten runs in a row divided by ten, so
    both measures span about as long and a busy machine slows both alike; a ratio past the bound
    is measured once more (best of two), since any single run can be stalled."""
    small, big = build(SMALL), build(BIG)
    assert len(small) == SMALL and len(big) == BIG

    def measure() -> tuple[float, float]:
        return sum(run(kind, name, small, streamed) for _ in range(10)) / 10, run(kind, name, big, streamed)

    t_small, t_big = measure()
    if t_big / max(t_small, 1e-5) >= MAX_RATIO:
        again = measure()
        t_small, t_big = min(t_small, again[0]), min(t_big, again[1])
    return t_big / max(t_small, 1e-5)


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind, name", chains(), ids=[n for _, n in chains()])
def test_parser_time_is_linear(kind, name, streamed):
    slow = {}
    for label, build in inputs_for(kind, name).items():
        r = ratio(kind, name, build, streamed)
        if r >= MAX_RATIO:
            slow[label] = round(r, 1)
    assert not slow, f"{name} ({'streamed' if streamed else 'whole'}): 100 kB / 10 kB time ratios {slow}"


def test_every_registered_parser_is_covered():
    names = {n for _, n in chains()}
    # The built-in ones at least; a plugin's parsers join the list above by registering.
    assert {"hermes", "mistral", "pythonic", "llama3_json", "deepseek_r1", "qwen3"} <= names
