"""Cases of the XML-style tool parsers (qwen3_coder, glm45/glm47, minimax_m2, seed_oss) and of
their families' reasoning parsers, in the shape of ``cases.py`` (which adds them to the table
that every split runs through)."""

from __future__ import annotations

from .helpers import Case, verbatim

PROPS = {"city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
         "hot": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": "array"},
         "none": {"type": "null"}, "either": {"type": ["integer", "string"]},
         "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]}, "ref": {"$ref": "#/$defs/Count"}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": PROPS, "$defs": {"Count": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "tz": {"type": "string"}}}}}]
TYPED = ('{"city": "Paris", "days": 3, "temp": -1.5, "hot": true, "opts": {"a": [1, null]}, "tags": ["x"], '
         '"none": null, "either": "7", "maybe": 4, "ref": 2}')
TYPED_VALUES = [("city", "Paris"), ("days", "3"), ("temp", "-1.5"), ("hot", "true"), ("opts", '{"a": [1, null]}'),
                ("tags", '["x"]'), ("none", "null"), ("either", "7"), ("maybe", "4"), ("ref", "2.0")]
MISTYPED = '{"days": "three", "temp": "1e999", "hot": "yes", "opts": "[1]", "tags": "[1", "none": "0"}'
MISTYPED_VALUES = [("days", "three"), ("temp", "1e999"), ("hot", "yes"), ("opts", "[1]"), ("tags", "[1"),
                   ("none", "0")]


def qwen(name: str, pairs: list[tuple[str, str]], open_: str = "<tool_call>", close: str = "</tool_call>") -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in pairs)
    return f"{open_}\n<function={name}>\n{params}</function>\n{close}"


def glm(name: str, pairs: list[tuple[str, str]], compact: bool = False) -> str:
    sep = "" if compact else "\n"
    params = "".join(f"<arg_key>{k}</arg_key>{sep}<arg_value>{v}</arg_value>{sep}" for k, v in pairs)
    return f"<tool_call>{name}{sep}{params}</tool_call>"


def minimax(*calls: tuple[str, list[tuple[str, str]]]) -> str:
    body = "".join(f'<invoke name="{n}">\n' + "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in ps)
                   + "</invoke>\n" for n, ps in calls)
    return f"<minimax:tool_call>\n{body}</minimax:tool_call>"


def seed(name: str, pairs: list[tuple[str, str]]) -> str:
    return qwen(name, pairs, "<seed:tool_call>", "</seed:tool_call>").replace(">\n", ">").replace("\n<", "<")


PARIS = '{"city": "Paris"}'
QWEN3_CODER = [
    verbatim("no_call", "Use <function=x> in prose."),
    Case("text_before", "Let me check.\n" + qwen("get_weather", [("city", "Paris")]), content="Let me check.",
         calls=[("get_weather", PARIS)]),
    Case("typed", qwen("get_weather", TYPED_VALUES), calls=[("get_weather", TYPED)], tools=TOOLS),
    Case("mistyped_stays_string", qwen("get_weather", MISTYPED_VALUES), calls=[("get_weather", MISTYPED)],
         tools=TOOLS),
    Case("untyped_tool_gives_strings", qwen("other", [("n", "3"), ("b", "true")]),
         calls=[("other", '{"n": "3", "b": "true"}')], tools=TOOLS),
    Case("parallel", qwen("get_weather", [("city", "Paris")]) + "\n" + qwen("get_time", []),
         calls=[("get_weather", PARIS), ("get_time", "{}")], tools=TOOLS),
    Case("two_functions_in_one_block", "<tool_call>\n<function=get_time>\n</function>\n<function=get_time>\n"
         "<parameter=tz>\nCET\n</parameter>\n</function>\n</tool_call>",
         calls=[("get_time", "{}"), ("get_time", '{"tz": "CET"}')], tools=TOOLS),
    Case("multiline_code_value", qwen("run", [("code", "def f():\n    return '</function>'\n")]),
         calls=[("run", '{"code": "def f():\\n    return \'</function>\'\\n"}')]),
    Case("non_ascii", qwen("translate", [("text", "你好, wörld 👋")]),
         calls=[("translate", '{"text": "你好, wörld 👋"}')]),
    Case("repeated_parameter_keeps_last", qwen("get_time", [("tz", "UTC"), ("tz", "CET")]),
         calls=[("get_time", '{"tz": "CET"}')]),
    Case("text_after", qwen("get_time", []) + "\nDone.", content="\nDone.", calls=[("get_time", "{}")]),
    Case("missing_end_tag", "<tool_call>\n<function=get_time>\n</function>", calls=[("get_time", "{}")]),
    verbatim("truncated_in_value", "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"),
    verbatim("truncated_after_parameter",
             "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"),
    verbatim("missing_parameter_end", "<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>"),
    Case("malformed_then_good", "<tool_call>\nget_time()\n</tool_call>\n" + qwen("get_time", []),
         content="<tool_call>\nget_time()\n</tool_call>", calls=[("get_time", "{}")]),
    verbatim("name_is_a_marker", "<tool_call>\n<function=f>\n<parameter=</parameter>>x</parameter>\n</function>\n"
             "</tool_call>"),
    verbatim("value_holding_the_start_marker", "<tool_call>\n<function=f>\n<parameter=a>\n<tool_call>\n</parameter>\n"
             "</function>\n</tool_call>"),
]
QWEN3_XML = [Case("alias", qwen("get_weather", [("days", "2")]), calls=[("get_weather", '{"days": 2}')], tools=TOOLS)]

GLM45 = [
    verbatim("no_call", "GLM answers."),
    Case("text_before", "Checking.\n" + glm("get_weather", [("city", "Paris")]), content="Checking.",
         calls=[("get_weather", PARIS)]),
    Case("typed", glm("get_weather", TYPED_VALUES), calls=[("get_weather", TYPED)], tools=TOOLS),
    Case("mistyped_stays_string", glm("get_weather", MISTYPED_VALUES), calls=[("get_weather", MISTYPED)],
         tools=TOOLS),
    Case("parallel", glm("get_weather", [("city", "Paris")]) + "\n" + glm("get_time", [("tz", "CET")]),
         calls=[("get_weather", PARIS), ("get_time", '{"tz": "CET"}')], tools=TOOLS),
    Case("glm47_layout", glm("get_weather", [("city", "Paris"), ("days", "2")], compact=True),
         calls=[("get_weather", '{"city": "Paris", "days": 2}')], tools=TOOLS),
    Case("no_arguments", "<tool_call>get_time</tool_call>", calls=[("get_time", "{}")]),
    Case("value_kept_verbatim", glm("note", [("text", "\n two\nlines ")]),
         calls=[("note", '{"text": "\\n two\\nlines "}')]),
    Case("missing_end_tag", "<tool_call>get_time\n<arg_key>tz</arg_key>\n<arg_value>UTC</arg_value>",
         calls=[("get_time", '{"tz": "UTC"}')]),
    verbatim("truncated_in_value", "<tool_call>get_time\n<arg_key>tz</arg_key>\n<arg_value>UT"),
    verbatim("key_without_value", "<tool_call>f\n<arg_key>a</arg_key>\n</tool_call> ok"),
    verbatim("prose_in_tags", "The <tool_call>tag is</tool_call> here."),
    Case("malformed_then_good", "<tool_call></tool_call>" + glm("get_time", []), content="<tool_call></tool_call>",
         calls=[("get_time", "{}")]),
]
GLM47 = [
    Case("compact", "Ok." + glm("get_weather", [("city", "Paris")], compact=True) + glm("get_time", [], compact=True),
         content="Ok.", calls=[("get_weather", PARIS), ("get_time", "{}")]),
    Case("glm45_layout", glm("get_weather", [("days", "5")]), calls=[("get_weather", '{"days": 5}')], tools=TOOLS),
    verbatim("truncated", "<tool_call>get_weather<arg_key>city"),
]

MINIMAX_M2 = [
    verbatim("no_call", "MiniMax answers."),
    Case("text_before", "Let me see.\n" + minimax(("get_weather", [("city", "Paris")])), content="Let me see.",
         calls=[("get_weather", PARIS)]),
    Case("typed", minimax(("get_weather", TYPED_VALUES)), calls=[("get_weather", TYPED)], tools=TOOLS),
    Case("mistyped_stays_string", minimax(("get_weather", MISTYPED_VALUES)), calls=[("get_weather", MISTYPED)],
         tools=TOOLS),
    Case("parallel_invokes", minimax(("get_weather", [("city", "Paris")]), ("get_time", [])),
         calls=[("get_weather", PARIS), ("get_time", "{}")]),
    Case("two_blocks", minimax(("get_time", [])) + "\n" + minimax(("get_time", [("tz", "CET")])),
         calls=[("get_time", "{}"), ("get_time", '{"tz": "CET"}')]),
    Case("quotes_optional", "<minimax:tool_call><invoke name=get_time><parameter name='tz'>UTC</parameter></invoke>"
         "</minimax:tool_call>", calls=[("get_time", '{"tz": "UTC"}')]),
    Case("text_after", minimax(("get_time", [])) + " Done.", content=" Done.", calls=[("get_time", "{}")]),
    verbatim("truncated", '<minimax:tool_call>\n<invoke name="get_time">\n<parameter name="tz">UT'),
    Case("missing_end_tag", '<minimax:tool_call>\n<invoke name="get_time">\n</invoke>', calls=[("get_time", "{}")]),
    verbatim("malformed", "<minimax:tool_call>get_time()</minimax:tool_call> sorry"),
]

SEED_OSS = [
    verbatim("no_call", "Seed answers."),
    Case("text_before", "Checking.\n" + seed("get_weather", [("city", "Paris")]), content="Checking.",
         calls=[("get_weather", PARIS)]),
    Case("typed", seed("get_weather", TYPED_VALUES), calls=[("get_weather", TYPED)], tools=TOOLS),
    Case("parallel", seed("get_weather", [("city", "Paris")]) + seed("get_time", []),
         calls=[("get_weather", PARIS), ("get_time", "{}")]),
    verbatim("truncated", "<seed:tool_call><function=get_time><parameter=tz>UT"),
    verbatim("malformed", "<seed:tool_call>oops</seed:tool_call>"),
]

XML_TOOL_CASES = {"qwen3_coder": QWEN3_CODER, "qwen3_xml": QWEN3_XML, "glm45": GLM45, "glm47": GLM47,
                  "minimax_m2": MINIMAX_M2, "seed_oss": SEED_OSS}
for _name, _cases in XML_TOOL_CASES.items():
    for _case in _cases:
        _case.tool_parser = _name

XML_REASONING_CASES = [
    Case("qwen3_second_end_tag", "<think>a</think>b</think>c", reasoning="a", content="bc", reasoning_parser="qwen3"),
    Case("qwen3_second_end_tag_disabled", "Hi</think> there", content="Hi there", reasoning_parser="qwen3",
         template_kwargs={"enable_thinking": False}),
    Case("glm45_complete", "<think>hmm</think>Hello!", reasoning="hmm", content="Hello!", reasoning_parser="glm45"),
    Case("glm45_opened_in_prompt", "hmm</think>Hello!", reasoning="hmm", content="Hello!", reasoning_parser="glm45"),
    Case("glm45_disabled", "Hello!</think>", content="Hello!", reasoning_parser="glm45",
         template_kwargs={"enable_thinking": False}),
    Case("glm45_truncated", "<think>still", reasoning="still", reasoning_parser="glm45"),
    Case("minimax_m2_starts_inside", "thinking...\n</think>\n\nAnswer.", reasoning="thinking...\n",
         content="\n\nAnswer.", reasoning_parser="minimax_m2"),
    Case("minimax_m2_leading_tag", "<think>x</think>y", reasoning="x", content="y", reasoning_parser="minimax_m2"),
    Case("minimax_m2_truncated", "never ends", reasoning="never ends", reasoning_parser="minimax_m2"),
    Case("seed_oss_complete", "<seed:think>plan</seed:think>Done.", reasoning="plan", content="Done.",
         reasoning_parser="seed_oss"),
    Case("seed_oss_absent", "Just the answer </seed:think>.", content="Just the answer .", reasoning_parser="seed_oss"),
    Case("seed_oss_truncated", "<seed:think>plan", reasoning="plan", reasoning_parser="seed_oss"),
    verbatim("seed_oss_partial_tag", "<seed:thi", reasoning_parser="seed_oss"),
    Case("chain_glm45", "<think>need weather</think>" + glm("get_weather", [("days", "1")]), reasoning="need weather",
         calls=[("get_weather", '{"days": 1}')], reasoning_parser="glm45", tool_parser="glm45", tools=TOOLS),
    Case("chain_minimax_m2", "weather?</think>\n" + minimax(("get_weather", [("city", "Paris")])),
         reasoning="weather?", calls=[("get_weather", PARIS)], reasoning_parser="minimax_m2", tool_parser="minimax_m2"),
    Case("chain_seed_oss", "<seed:think>ok</seed:think>" + seed("get_time", []), reasoning="ok",
         calls=[("get_time", "{}")], reasoning_parser="seed_oss", tool_parser="seed_oss"),
    Case("chain_qwen3_coder_call_inside_think", "I will call it.\n" + qwen("get_time", []),
         reasoning="I will call it.\n",
         calls=[("get_time", "{}")], reasoning_parser="qwen3", tool_parser="qwen3_coder"),
]

XML_CASES = [case for cases in XML_TOOL_CASES.values() for case in cases] + XML_REASONING_CASES
