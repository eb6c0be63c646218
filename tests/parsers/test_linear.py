"""Every registered tool and reasoning parser takes time linear in the model's output, streamed
(in deltas of 1 to 7 characters) and whole, on adversarial output: unclosed ``<tool_call>`` and
``<think>`` tags by the thousand, ``[`` followed by thousands of ``a(``, deep brackets, objects
nested and left open, lists of thousands of elements that are not calls (each one held until
the list has a call), and each parser's own markers repeated or followed by those. The parsers
are read from the registry at run time, so a parser added later is covered too.

A prompt-injected model can be made to write any of these; a parser quadratic in them pins the
server's event loop for minutes per request. The measure is the ratio of the time for 128 kB to
the time for 4 kB: about 32 when linear, about 1000 when quadratic. The bound, 80, sits far from
both, so noise cannot turn one into the other: it fails a parser whose quadratic part is, at
128 kB, 1.6 times its linear part or more (one that takes 14 times as long as it should at 1 MB).
The times are the thread's CPU time (``time.thread_time``) with the garbage collector paused, each
the best of the runs made; a ratio that is not clearly linear is measured again, up to three
rounds, since noise only ever adds time. ``test_a_quadratic_parser_is_caught`` runs a
deliberately quadratic parser through the same measure.
"""

from __future__ import annotations

import gc
import time
from itertools import cycle
from typing import Any

import pytest

from llmserve.parsing.chain import ParseChain
from llmserve.parsing.contract import ParseDelta, ToolParser

from .helpers import registry

SMALL, BIG = 4_000, 128_000  # 32 times as much output
MAX_RATIO = 80  # linear: about 32; quadratic: about 1000
CLEAR = 48  # clearly linear: not measured again
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


def chain_maker(kind: str, name: str):
    make = {"tool_parser": name} if kind == "tool_parser" else {"reasoning_parser": name}
    return lambda: ParseChain.create(registry(), tools=TOOLS, **make)


def run(new_chain, text: str, streamed: bool, budget: float = float("inf")) -> float:
    """CPU seconds this thread spent parsing ``text`` with a fresh chain, the collector paused.
    Streamed parsing stops once past ``budget`` seconds (a quadratic parser would take minutes):
    the time returned then is over the budget, which is all the caller needs to know."""
    chain = new_chain()
    gc.disable()
    try:
        start = time.thread_time()
        if streamed:
            pos = 0
            for i, size in enumerate(cycle(range(1, 8))):
                if pos >= len(text):
                    break
                chain.feed(text[pos:pos + size])
                pos += size
                if i % 256 == 255 and time.thread_time() - start > budget:
                    return time.thread_time() - start
            chain.finish()
            chain.result()
        else:
            chain.parse(text)
        return time.thread_time() - start
    finally:
        gc.enable()


def ratio(new_chain, build, streamed: bool) -> float:
    """time(128 kB) / time(4 kB), each the best of the runs made. Noise only adds time, so a
    ratio that is not clearly linear (under ``CLEAR``) is measured again, up to three rounds:
    a parser fails only if the best times of all three keep it at the bound."""
    small, big = build(SMALL), build(BIG)
    assert len(small) == SMALL and len(big) == BIG
    run(new_chain, small, streamed)  # warms caches up
    smalls: list[float] = []
    bigs: list[float] = []
    for _ in range(3):
        smalls += [run(new_chain, small, streamed) for _ in range(3)]
        t_small = max(min(smalls), 1e-6)
        bigs.append(run(new_chain, big, streamed, budget=2 * MAX_RATIO * t_small))
        if min(bigs) / t_small < CLEAR:
            break
    return min(bigs) / t_small


class Rescanning(ToolParser):
    """A deliberately quadratic parser: every delta re-reads all the output so far (the mistake
    this file is there to catch), in slices, as a parser looking for its markers would."""

    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self.text = ""

    def feed(self, text: str, token_ids: Any = ()) -> ParseDelta:
        self.text += text
        for i in range(0, len(self.text), 64):
            if "]" in self.text[i:i + 64]:
                break
        return ParseDelta(content=text)

    def finish(self) -> ParseDelta:
        return ParseDelta()


def test_a_quadratic_parser_is_caught():
    r = ratio(lambda: ParseChain(Rescanning()), generic_inputs()["[ nested"], streamed=True)
    assert r >= MAX_RATIO, f"a quadratic parser measured {r:.1f}, under the bound {MAX_RATIO}"


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind, name", chains(), ids=[n for _, n in chains()])
def test_parser_time_is_linear(kind, name, streamed):
    slow = {}
    for label, build in inputs_for(kind, name).items():
        r = ratio(chain_maker(kind, name), build, streamed)
        if r >= MAX_RATIO:
            slow[label] = round(r, 1)
    assert not slow, f"{name} ({'streamed' if streamed else 'whole'}): 128 kB / 4 kB time ratios {slow}"


def test_every_registered_parser_is_covered():
    names = {n for _, n in chains()}
    # The built-in ones at least; a plugin's parsers join the list above by registering.
    assert {"hermes", "mistral", "pythonic", "llama3_json", "deepseek_r1", "qwen3"} <= names
