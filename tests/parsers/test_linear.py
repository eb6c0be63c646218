"""Every registered tool and reasoning parser takes time linear in the model's output, streamed
(in deltas of 1 to 7 characters) and whole, on adversarial output: unclosed ``<tool_call>`` and
``<think>`` tags by the thousand, ``[`` followed by thousands of ``a(``, deep brackets, objects
nested and left open, lists of thousands of elements that are not calls (each one held until
the list has a call), each parser's own markers repeated or followed by those, and for the
XML-style families calls left open by the thousand, thousands of parameters and one huge value.
The parsers are read from the registry at run time, so a parser added later is covered too.

A prompt-injected model can be made to write any of these; a parser quadratic in them pins the
server's event loop for minutes per request. The measure is the ratio of the time for 32 kB to
the time for 1 kB: about 32 when linear, about 1000 when quadratic. The bound, 100, sits far from
both, so noise cannot turn one into the other: it fails a parser whose quadratic part is, at
32 kB, about twice its linear part or more. The times are the thread's CPU time
(``time.thread_time``) with the garbage collector paused. The big time is the best of the runs
made; the small one is the best of means of four back-to-back runs, since the best of single
1 kB runs (a fraction of a millisecond each) is a lucky outlier often enough to push a linear
parser's ratio past 80 on a loaded machine. A ratio that is not clearly linear is measured
again, up to three rounds, since noise only ever adds time. ``test_a_quadratic_parser_is_caught`` runs a
deliberately quadratic parser through the same measure.

Cost (CI runs this for some 25 parsers, each on 15 to 30 inputs, twice): the ratio only needs
two sizes 32 times apart, so they are 1 kB and 32 kB, a quarter of the 4 kB / 128 kB this test
began with, and each parser costs a quarter as much. The big run is nearly all of a measure's
time, streamed above all (a delta costs the same fixed work whatever it holds), and it is made
once when the ratio is clearly linear. What the smaller sizes give up: a quadratic part must be
1.6 times the linear part at 32 kB rather than at 128 kB to fail, which still fails every
parser that rescans its buffer per delta or per region (``test_a_quadratic_parser_is_caught``
measures such a parser at about 160, well over the bound). The rest goes on what was measured twice before:
one test per parser measures whole and streamed over the same inputs, warmed up once per mode
rather than once per input; inputs that are the same text (``<tool_call> repeated`` is
``unclosed <tool_call>``) are measured once; and parsers that are one class under two names are
measured once, under the first name. None of these changes what is measured for any parser.
"""

from __future__ import annotations

import gc
import time
from itertools import cycle
from typing import Any, Callable

import pytest

from llmserve.parsing.chain import ParseChain
from llmserve.parsing.contract import ParseDelta, ToolParser

from .helpers import registry

SMALL, BIG = 1_000, 32_000  # 32 times as much output
MAX_RATIO = 100  # linear: about 32; quadratic: about 1000
CLEAR = 48  # clearly linear: not measured again
Builder = Callable[[int], str]  # the size -> that much output
TOOLS = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": {}}}}]


def repeat(unit: str, size: int) -> str:
    return (unit * (size // len(unit) + 1))[:size]


def generic_inputs() -> dict[str, Builder]:
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


def family_inputs(name: str) -> dict[str, Builder]:
    """Inputs for the XML-style families: a call left open in its first value, by the thousand;
    one call with as many parameters as fit (a thousand and more at 32 kB; test_xml_params.py
    parses 10k); one parameter with a value as long as the output; parameter names that are the
    family's own markers."""
    units = XML_FAMILIES.get(name)
    if units is None:
        return {}
    start, param, close = units
    opened = param.format("k", "VALUE")
    opened = start + opened[:opened.index("VALUE") + 5]
    bare = len(start + param.format("k", "") + close)
    return {
        "calls left open": lambda n: repeat(opened, n),
        "thousands of parameters": lambda n: start + repeat(param.format("k", "v"), n - len(start) - len(close))
        + close,
        "one huge value": lambda n: start + param.format("k", repeat("v", n - bare)) + close,
        "marker names": lambda n: start + repeat(param.format(start, close), n - len(start)),
    }


# name -> (call start, one parameter as "{}" key and "{}" value, call end) of the XML families.
XML_FAMILIES = {
    "qwen3_coder": ("<tool_call>\n<function=a>\n", "<parameter={}>\n{}\n</parameter>\n", "</function>\n</tool_call>"),
    "seed_oss": ("<seed:tool_call><function=a>", "<parameter={}>{}</parameter>", "</function></seed:tool_call>"),
    "glm45": ("<tool_call>a\n", "<arg_key>{}</arg_key>\n<arg_value>{}</arg_value>\n", "</tool_call>"),
    "glm47": ("<tool_call>a", "<arg_key>{}</arg_key><arg_value>{}</arg_value>", "</tool_call>"),
    "minimax_m2": ('<minimax:tool_call><invoke name="a">', '<parameter name="{}">{}</parameter>',
                   "</invoke></minimax:tool_call>"),
}


def inputs_for(kind: str, name: str) -> dict[str, Builder]:
    """The adversarial inputs of one parser, each text once (the first label kept)."""
    out = generic_inputs()
    for m in markers(kind, name):
        out[f"{m} repeated"] = lambda n, m=m: repeat(m, n)
        out[f"{m} then [ and a("] = lambda n, m=m: m + "[" + repeat("a(", n - len(m) - 1)
        out[f"{m} then objects nested"] = lambda n, m=m: m + repeat('{"a": ', n - len(m))
        out[f"{m} then words and ["] = lambda n, m=m: m + repeat("x [", n - len(m))
        out[f"{m} then objects that are not calls"] = lambda n, m=m: m + "[" + repeat('{"a": 1}, ', n - len(m) - 1)
    out.update(family_inputs(name))
    seen: set[str] = set()
    unique: dict[str, Builder] = {}
    for label, build in out.items():
        text = build(SMALL)
        if text not in seen:
            seen.add(text)
            unique[label] = build
    return unique


def chains() -> list[tuple[str, str]]:
    """``(kind, name)`` of every registered parser, one name per class (module doc)."""
    reg = registry()
    out, classes = [], set()
    for kind in ("tool_parser", "reasoning_parser"):
        for name in reg.names(kind):
            cls = reg.load(kind, name)
            if (kind, cls) not in classes:
                classes.add((kind, cls))
                out.append((kind, name))
    return out


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


def ratio(new_chain, build, streamed: bool, warm: bool = True) -> float:
    """time(32 kB) / time(1 kB), each the best of the runs made. Noise only adds time, so a
    ratio that is not clearly linear (under ``CLEAR``) is measured again, up to three rounds:
    a parser fails only if the best times of all three keep it at the bound. ``warm``: run the
    small input once first (caches, first imports); a caller measuring several inputs in a row
    warms up once."""
    small, big = build(SMALL), build(BIG)
    assert len(small) == SMALL and len(big) == BIG
    if warm:
        run(new_chain, small, streamed)
    smalls: list[float] = []
    bigs: list[float] = []
    for _ in range(3):
        smalls += [sum(run(new_chain, small, streamed) for _ in range(4)) / 4 for _ in range(3)]
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


@pytest.mark.parametrize("kind, name", chains(), ids=[n for _, n in chains()])
def test_parser_time_is_linear(kind, name):
    slow = {}
    make = chain_maker(kind, name)
    inputs = inputs_for(kind, name)
    for streamed in (False, True):
        first = True
        for label, build in inputs.items():
            r = ratio(make, build, streamed, warm=first)
            first = False
            if r >= MAX_RATIO:
                slow[f"{label} ({'streamed' if streamed else 'whole'})"] = round(r, 1)
    assert not slow, f"{name}: 32 kB / 1 kB time ratios {slow}"


def test_every_registered_parser_is_covered():
    names = {n for _, n in chains()}
    # The built-in ones at least; a plugin's parsers join the list above by registering.
    assert {"hermes", "mistral", "pythonic", "llama3_json", "deepseek_r1", "qwen3"} <= names
