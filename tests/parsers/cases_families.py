"""Cases of the tool parsers openai (harmony), kimi_k2, deepseek_v3, deepseek_v31,
phi4_mini_json and lfm2, and of the reasoning parsers openai_gptoss, kimi_k2, deepseek_v3,
mistral and granite, in the shape of ``cases.py`` (which adds them to the table that every
split runs through). Formats as the models' chat templates write them."""

from __future__ import annotations

from typing import Callable

from .helpers import Case, verbatim

WEATHER = '{"city": "Paris", "unit": "celsius"}'
NESTED = '{"q": {"f": [{"v": ["a\\"b", "c\\\\d", -1.5e-3, true, null]}], "braces": "} { ] ["}, "n": 10}'
UNICODE = '{"text": "你好, wörld 👋", "esc": "\\u00e9"}'
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("get_weather", "get_time", "search")]

# Kimi-K2
K_SEC, K_SEC_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"


def kimi(name: str, args: str, idx: int = 0) -> str:
    return f"<|tool_call_begin|>functions.{name}:{idx}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


def kimi_section(*calls: str) -> str:
    return K_SEC + "".join(calls) + K_SEC_END


# DeepSeek-V3 and V3.1
D_SEC, D_SEC_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def ds3(name: str, args: str) -> str:
    return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"


def ds31(name: str, args: str) -> str:
    return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>"


def ds_section(*calls: str, sep: str = "") -> str:
    return D_SEC + sep.join(calls) + D_SEC_END


def named_rules(block: Callable[[str, str], str], section: Callable[..., str], opener: str) -> list[Case]:
    """The malformed-output rules for formats whose call is a header naming the function and
    a bare JSON object: a block that is not a call is content verbatim (section markers are
    dropped), a cut-off object is kept closed, text around calls is content."""
    good = block("f", '{"a": 1}')
    start = good[:good.index("{")]
    end_marker = good[good.rindex("}") + 1:]

    def bad(rid: str, args: str) -> Case:
        return verbatim(rid, section(block("f", args)))

    return [
        Case("rule_valid", section(good), calls=[("f", '{"a": 1}')]),
        bad("rule_broken_in_arguments", '{"a": 1, "b": }'),
        bad("rule_unescaped_quote", '{"code": "print("hi")"}'),
        bad("rule_single_quotes", "{'a': 1}"),
        bad("rule_trailing_comma", '{"a": 1,}'),
        bad("rule_arguments_list", "[1, 2]"),
        bad("rule_arguments_string", '"a=1"'),
        verbatim("rule_end_marker_inside_object", section(start + '{"a": 1' + end_marker)),
        Case("rule_cut_off_in_arguments", opener + start + '{"a": 1, "b": "x',
             calls=[("f", '{"a": 1, "b": "x"}')]),
        verbatim("rule_cut_off_before_arguments", "Sure." + start[:-2]),
        Case("rule_raw_newline_in_string", section(block("run", '{"code": "a = 1\nprint(a)"}')),
             calls=[("run", '{"code": "a = 1\\nprint(a)"}')]),
        Case("rule_text_around_calls",
             "Before. " + section(block("a", "{}")) + " mid " + section(block("c", '{"x": 1}')) + " After.",
             content="Before. mid After.", calls=[("a", "{}"), ("c", '{"x": 1}')]),
        Case("rule_whitespace_next_to_calls", "Before.\n\n" + section(block("a", "{}"), block("c", '{"x": 1}')) + "\n",
             content="Before.", calls=[("a", "{}"), ("c", '{"x": 1}')]),
        Case("rule_bad_between_good", section(block("a", "{}"), block("b", "{oops}"), block("c", '{"x": 1}')),
             content=block("b", "{oops}"), calls=[("a", "{}"), ("c", '{"x": 1}')]),
        Case("nested_escaped", section(block("search", NESTED)), calls=[("search", NESTED)]),
        Case("non_ascii", "Voilà :" + section(block("translate", UNICODE)), content="Voilà :",
             calls=[("translate", UNICODE)]),
        verbatim("no_call", "The weather is nice { today }."),
        verbatim("rule_cut_off_before_first_call", "Sure. " + opener + start[:-3]),
        Case("rule_call_without_section", "Now " + block("a", "{}") + " then", content="Now then", calls=[("a", "{}")]),
        Case("rule_sections_with_and_without_calls", section(block("a", "{}")) + " x " + section(" nothing ")
             + section(block("c", '{"x": 1}')), content=" x " + section(" nothing "),
             calls=[("a", "{}"), ("c", '{"x": 1}')]),
    ]


KIMI = [
    Case("parallel", "Let me check." + kimi_section(kimi("get_weather", WEATHER), kimi("get_time", '{"tz": "CET"}', 1)),
         content="Let me check.", calls=[("get_weather", WEATHER), ("get_time", '{"tz": "CET"}')]),
    Case("whitespace_in_section", K_SEC + "\n" + kimi("get_time", "{}") + "\n" + kimi("get_time", "{}", 1) + "\n"
         + K_SEC_END, calls=[("get_time", "{}"), ("get_time", "{}")]),
    Case("no_functions_prefix", K_SEC + "<|tool_call_begin|>get_time:0<|tool_call_argument_begin|>{}<|tool_call_end|>"
         + K_SEC_END, calls=[("get_time", "{}")]),
    verbatim("bad_header", K_SEC + "<|tool_call_begin|>functions.get time:0<|tool_call_argument_begin|>{}"
             "<|tool_call_end|>" + K_SEC_END),
    verbatim("no_argument_marker", K_SEC + "<|tool_call_begin|>functions.get_time:0{}<|tool_call_end|>" + K_SEC_END),
    verbatim("truncated_marker", "Answer: 42<|tool_calls_sec"),
    *named_rules(kimi, kimi_section, K_SEC),
]

DEEPSEEK_V3 = [
    Case("parallel", "Ok." + ds_section(ds3("get_weather", WEATHER), ds3("get_time", '{"tz": "CET"}'), sep="\n"),
         content="Ok.", calls=[("get_weather", WEATHER), ("get_time", '{"tz": "CET"}')]),
    Case("no_fence", ds_section("<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n{}<｜tool▁call▁end｜>"),
         calls=[("get_time", "{}")]),
    verbatim("not_function_type", ds_section("<｜tool▁call▁begin｜>tool<｜tool▁sep｜>get_time\n```json\n{}\n```"
             "<｜tool▁call▁end｜>")),
    verbatim("v31_format_is_not_v3", ds_section(ds31("get_time", "{}"))),
    Case("truncated_after_object", D_SEC + ds3("get_time", "{}")[:-20], calls=[("get_time", "{}")]),
    *named_rules(ds3, ds_section, D_SEC),
]

DEEPSEEK_V31 = [
    Case("parallel", ds_section(ds31("get_weather", WEATHER), ds31("get_time", '{"tz": "CET"}')),
         calls=[("get_weather", WEATHER), ("get_time", '{"tz": "CET"}')]),
    Case("text_before", "Checking the weather.\n\n" + ds_section(ds31("get_weather", WEATHER)),
         content="Checking the weather.", calls=[("get_weather", WEATHER)]),
    verbatim("v3_format_is_not_v31", ds_section(ds3("get_time", "{}"))),
    verbatim("name_with_space", ds_section(ds31("get time", "{}"))),
    *named_rules(ds31, ds_section, D_SEC),
]

PHI4 = [
    verbatim("no_call", "The functools module has reduce()."),
    Case("parallel", f'functools[{{"name": "get_weather", "arguments": {WEATHER}}}, '
         '{"name": "get_time", "arguments": {"tz": "CET"}}]',
         calls=[("get_weather", WEATHER), ("get_time", '{"tz": "CET"}')]),
    Case("text_before_and_after", 'Sure. functools[{"name": "get_time", "parameters": {}}] Done.',
         content="Sure. Done.", calls=[("get_time", "{}")]),
    Case("space_before_list", 'functools [{"name": "get_time", "arguments": {}}]', calls=[("get_time", "{}")]),
    verbatim("single_object_is_not_a_list", 'functools{"name": "get_time", "arguments": {}}'),
    Case("nested_escaped", f'functools[{{"name": "search", "arguments": {NESTED}}}]', calls=[("search", NESTED)]),
    verbatim("truncated_marker", "use functo"),
]

LFM2 = [
    verbatim("no_call", "It is [probably] sunny."),
    Case("parallel", "<|tool_call_start|>[get_weather(city='Paris', days=3), get_time(tz=None)]<|tool_call_end|>",
         calls=[("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", '{"tz": null}')]),
    Case("text_around", 'Checking.<|tool_call_start|>[get_time(tz="CET")]<|tool_call_end|>Done.',
         content="Checking.Done.", calls=[("get_time", '{"tz": "CET"}')]),
    Case("two_lists", "<|tool_call_start|>[a()]<|tool_call_end|>\n<|tool_call_start|>[b(x=1)]<|tool_call_end|>",
         calls=[("a", "{}"), ("b", '{"x": 1}')]),
    Case("space_before_list", "<|tool_call_start|>\n [get_time()]<|tool_call_end|>", calls=[("get_time", "{}")]),
    Case("bad_sibling", "<|tool_call_start|>[a(), b(1), c(x=[1, {'k': 'v'}])]<|tool_call_end|>", content=" b(1)",
         calls=[("a", "{}"), ("c", '{"x": [1, {"k": "v"}]}')]),
    verbatim("not_calls", "<|tool_call_start|>[1, 2]<|tool_call_end|>"),
    verbatim("not_a_list", "<|tool_call_start|>get_time()<|tool_call_end|>"),
    Case("truncated_keeps_complete_calls", "<|tool_call_start|>[a(), get_weather(city='Pa",
         calls=[("a", "{}")]),
    verbatim("truncated_marker", "Done.<|tool_call_st"),
]

# Harmony (gpt-oss). The generation prompt ends in "<|start|>assistant", so the output starts
# with "<|channel|>"; later messages repeat "<|start|>assistant".
A = "<|start|>assistant"


def analysis(text: str, first: bool = False) -> str:
    return ("" if first else A) + f"<|channel|>analysis<|message|>{text}<|end|>"


def hcall(name: str, args: str, channel: str = "commentary", first: bool = False) -> str:
    return ("" if first else A) + f"<|channel|>{channel} to=functions.{name} <|constrain|>json<|message|>{args}<|call|>"


def final(text: str) -> str:
    return f"{A}<|channel|>final<|message|>{text}<|return|>"


HARMONY = [
    Case("final_only", "<|channel|>final<|message|>It is sunny.<|return|>", content="It is sunny."),
    Case("analysis_then_call", analysis("Need the weather.", True) + hcall("get_weather", WEATHER),
         content="Need the weather.", calls=[("get_weather", WEATHER)]),
    # Real gpt-oss models put many calls on the analysis channel: they are calls too.
    Case("call_on_analysis_channel", analysis("Checking.", True) + hcall("get_time", '{"tz": "CET"}', "analysis"),
         content="Checking.", calls=[("get_time", '{"tz": "CET"}')]),
    Case("recipient_in_role", '<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.get_time'
         '<|channel|>commentary json<|message|>{}<|call|>', content="x", calls=[("get_time", "{}")]),
    Case("first_message_is_call", hcall("get_time", "{}", first=True), calls=[("get_time", "{}")]),
    Case("interleaved_channels", analysis("a1", True) + A + "<|channel|>commentary<|message|>One moment.<|end|>"
         + hcall("get_weather", WEATHER) + analysis("a2") + hcall("get_time", "{}", "analysis") + final("Done."),
         content="a1One moment.a2Done.", calls=[("get_weather", WEATHER), ("get_time", "{}")]),
    Case("nested_escaped", hcall("search", NESTED, first=True), calls=[("search", NESTED)]),
    Case("non_ascii", hcall("translate", UNICODE, first=True), calls=[("translate", UNICODE)]),
    verbatim("body_not_json", hcall("get_time", "tz=CET", first=True)),
    verbatim("body_not_object", hcall("get_time", "[1]", first=True)),
    verbatim("builtin_recipient", "<|channel|>analysis to=browser.search<|message|>{\"query\": \"x\"}<|call|>"),
    Case("truncated_in_arguments", analysis("hm", True) + A + '<|channel|>commentary to=functions.get_weather '
         '<|constrain|>json<|message|>{"city": "Par', content="hm", calls=[("get_weather", '{"city": "Par"}')]),
    verbatim("truncated_in_header", "<|channel|>commentary to=functions.get_wea"),
    Case("truncated_marker", "<|channel|>final<|message|>Hi<|ret", content="Hi<|ret"),
    Case("next_header_ends_message", "<|channel|>final<|message|>Hi" + hcall("get_time", "{}"), content="Hi",
         calls=[("get_time", "{}")]),
    verbatim("plain_text", "No markers at all, a < b > c."),
    verbatim("stray_start", "x <|start|> y"),
]


GPTOSS = "openai_gptoss"
REASONING = [
    Case("gptoss_analysis_final", analysis("Think.", True) + final("Answer."), reasoning="Think.", content="Answer.",
         reasoning_parser=GPTOSS),
    Case("gptoss_truncated", "<|channel|>analysis<|message|>still thinking", reasoning="still thinking",
         reasoning_parser=GPTOSS),
    Case("gptoss_preamble_is_content", analysis("t", True) + A + "<|channel|>commentary<|message|>Looking.<|end|>",
         reasoning="t", content="Looking.", reasoning_parser=GPTOSS),
    Case("gptoss_call_passed_on", analysis("t", True) + hcall("get_time", "{}"), reasoning="t",
         content=hcall("get_time", "{}"), reasoning_parser=GPTOSS),
    Case("chain_gptoss_openai", analysis("Need weather.", True) + hcall("get_weather", WEATHER),
         reasoning="Need weather.", calls=[("get_weather", WEATHER)], reasoning_parser=GPTOSS, tool_parser="openai"),
    Case("chain_gptoss_openai_interleaved", analysis("a1", True) + hcall("get_weather", WEATHER, "analysis")
         + analysis("a2") + hcall("get_time", "{}") + final("Both done."), reasoning="a1a2", content="Both done.",
         calls=[("get_weather", WEATHER), ("get_time", "{}")], reasoning_parser=GPTOSS, tool_parser="openai"),
    Case("chain_gptoss_openai_bad_call", analysis("a", True) + hcall("f", "oops"), reasoning="a",
         content=hcall("f", "oops"), reasoning_parser=GPTOSS, tool_parser="openai"),
    Case("kimi_think", "<think>hmm</think>Hello.", reasoning="hmm", content="Hello.", reasoning_parser="kimi_k2"),
    verbatim("kimi_no_think", "Hello.</think>", reasoning_parser="kimi_k2"),
    Case("kimi_truncated", "<think>still", reasoning="still", reasoning_parser="kimi_k2"),
    Case("chain_kimi_section_ends_thinking", "<think>I need the time." + kimi_section(kimi("get_time", "{}")),
         reasoning="I need the time.", calls=[("get_time", "{}")], reasoning_parser="kimi_k2", tool_parser="kimi_k2"),
    Case("chain_kimi_after_think", "<think>ok</think>Sure." + kimi_section(kimi("get_time", "{}")), reasoning="ok",
         content="Sure.", calls=[("get_time", "{}")], reasoning_parser="kimi_k2", tool_parser="kimi_k2"),
    verbatim("ds3_non_thinking", "Hello! <think> is a tag.", reasoning_parser="deepseek_v3"),
    Case("ds3_thinking", "hmm</think>Hello!", reasoning="hmm", content="Hello!", reasoning_parser="deepseek_v3",
         template_kwargs={"thinking": True}),
    Case("ds3_thinking_truncated", "hmm", reasoning="hmm", reasoning_parser="deepseek_v3",
         template_kwargs={"thinking": True}),
    Case("ds3_leading_think", "<think>x</think>y", reasoning="x", content="y", reasoning_parser="deepseek_v3"),
    Case("chain_ds3_v31", "need time</think>" + ds_section(ds31("get_time", "{}")), reasoning="need time",
         calls=[("get_time", "{}")], reasoning_parser="deepseek_v3", tool_parser="deepseek_v31",
         template_kwargs={"thinking": True}),
    Case("mistral_think", "[THINK]Let me see.[/THINK]It is 4.", reasoning="Let me see.", content="It is 4.",
         reasoning_parser="mistral"),
    verbatim("mistral_absent", "It is 4. [THINK]", reasoning_parser="mistral"),
    Case("mistral_truncated", "[THINK]Let me", reasoning="Let me", reasoning_parser="mistral"),
    Case("mistral_partial_end", "[THINK]a [/THI", reasoning="a [/THI", reasoning_parser="mistral"),
    Case("granite_complete", "Here is my thought process:\n2 + 2 = 4.\nHere is my response:\nIt is 4.",
         reasoning="\n2 + 2 = 4.\n", content="\nIt is 4.", reasoning_parser="granite"),
    Case("granite_short_forms", " Here's my thought process: a Here's my response: b", reasoning=" a ", content=" b",
         reasoning_parser="granite"),
    verbatim("granite_absent", "It is 4. Here is my response: yes", reasoning_parser="granite"),
    Case("granite_truncated", "Here is my thought process: still Here is my", reasoning=" still Here is my",
         reasoning_parser="granite"),
    verbatim("granite_start_phrase_cut", "Here is my thought", reasoning_parser="granite"),
]

TOOL_CASES = {"openai": HARMONY, "kimi_k2": KIMI, "deepseek_v3": DEEPSEEK_V3, "deepseek_v31": DEEPSEEK_V31,
              "phi4_mini_json": PHI4, "lfm2": LFM2}
