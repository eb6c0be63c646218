"""Model outputs for every built-in parser, written from the formats, with the expected result.

Arguments are compared as exact strings: the parsers send the model's own JSON text (raw
control characters inside strings escaped), so these are the strings the API returns.
"""

from __future__ import annotations

from .cases_families import REASONING as FAMILY_REASONING
from .cases_families import TOOL_CASES as FAMILY_TOOL_CASES
from .cases_xml import XML_CASES
from .helpers import Case, verbatim

WEATHER = '{"city": "Paris", "unit": "celsius"}'
NESTED = ('{"query": {"filters": [{"field": "title", "op": "in", "values": ["a\\"b", "c\\\\d", -1.5e-3, 0, true, '
          'false, null]}], "braces": "} { ] [", "tag": "<b>x</b> </tool_call"}, "limit": 10}')
UNICODE = '{"text": "你好, wörld 👋", "to": "日本語", "esc": "\\u00e9\\ud83d\\ude00"}'
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("get_weather", "get_time", "search")]


def hermes_block(name: str, args: str, key: str = "arguments") -> str:
    return f'<tool_call>\n{{"name": "{name}", "{key}": {args}}}\n</tool_call>'


HERMES = [
    verbatim("no_call", "The weather is nice.\nNo tools needed."),
    verbatim("angle_brackets", "if a < b and c > d: <tool_"),
    Case("text_before", "Let me check that.\n" + hermes_block("get_weather", WEATHER),
         content="Let me check that.", calls=[("get_weather", WEATHER)]),
    Case("parallel", hermes_block("get_weather", WEATHER) + "\n" + hermes_block("get_time", '{"tz": "CET"}'),
         calls=[("get_weather", WEATHER), ("get_time", '{"tz": "CET"}')]),
    Case("nested_escaped", hermes_block("search", NESTED), calls=[("search", NESTED)]),
    Case("non_ascii", "Voilà :\n" + hermes_block("translate", UNICODE), content="Voilà :",
         calls=[("translate", UNICODE)]),
    Case("empty_arguments", hermes_block("get_time", "{}"), calls=[("get_time", "{}")]),
    Case("parameters_key", hermes_block("get_weather", WEATHER, key="parameters"), calls=[("get_weather", WEATHER)]),
    Case("arguments_before_name", '<tool_call>{"arguments": {"q": 1}, "id": 7, "name": "search"}</tool_call>',
         calls=[("search", '{"q": 1}')]),
    Case("arguments_as_string", '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>',
         calls=[("f", '{"a": [1, 2]}')]),
    verbatim("arguments_string_not_json", '<tool_call>{"name": "f", "arguments": "{\\"a\\": NaN}"}</tool_call>'),
    Case("list_in_block",
         '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]</tool_call>',
         calls=[("a", "{}"), ("b", '{"x": 1}')]),
    Case("raw_newline_in_string", '<tool_call>{"name": "run", "arguments": {"code": "a = 1\nprint(a)\t#"}}</tool_call>',
         calls=[("run", '{"code": "a = 1\\nprint(a)\\t#"}')]),
    Case("text_after", hermes_block("get_time", "{}") + "\nDone.", content="\nDone.", calls=[("get_time", "{}")]),
    Case("missing_end_tag", '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}',
         calls=[("get_time", '{"tz": "UTC"}')]),
    # Cut off inside the JSON, no end tag: content, nothing runs (the issue-39 fix).
    verbatim("truncated_in_arguments", 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),
    verbatim("truncated_after_key", '<tool_call>{"name": "f", "arguments": {"a": 1, "b": tr'),
    Case("truncated_list_keeps_complete_calls", '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "argu',
         calls=[("a", "{}")]),
    verbatim("truncated_before_name", 'Sure.\n<tool_call>\n{"name": "get_wea'),
    verbatim("malformed_not_json", '<tool_call>\nget_weather(city="Paris")\n</tool_call>'),
    Case("malformed_then_good", '<tool_call>oops</tool_call>\n' + hermes_block("get_time", "{}"),
         content="<tool_call>oops</tool_call>", calls=[("get_time", "{}")]),
    verbatim("malformed_after_name", '<tool_call>{"name": "f", "arguments": {"a": 1, "b": }}</tool_call> after'),
    Case("text_after_object_in_block", hermes_block("get_time", "{}").replace("}\n<", "} ok\n<"),
         content=" ok", calls=[("get_time", "{}")]),
    Case("bad_block_between_good", hermes_block("a", "{}") + '\n<tool_call>{"name": "b"}</tool_call>\n'
         + hermes_block("c", '{"x": 1}'), content='\n<tool_call>{"name": "b"}</tool_call>',
         calls=[("a", "{}"), ("c", '{"x": 1}')]),
    verbatim("name_not_string", '<tool_call>{"name": 5, "arguments": {}}</tool_call>'),
]

MISTRAL = [
    verbatim("no_call", "Bonjour ! Comment puis-je aider ?"),
    Case("v7_text_before", f'Sure, checking.[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER}}}]',
         content="Sure, checking.", calls=[("get_weather", WEATHER)]),
    Case("v7_parallel", '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]',
         calls=[("a", '{"x": 1}'), ("b", "{}")]),
    Case("v7_single_object", '[TOOL_CALLS] {"name": "a", "arguments": {"x": 1}}', calls=[("a", '{"x": 1}')]),
    Case("v7_trailing_text", '[TOOL_CALLS] [{"name": "a", "arguments": {}}] hope that helps',
         content=" hope that helps", calls=[("a", "{}")]),
    Case("v11_parallel", f'[TOOL_CALLS]get_weather{WEATHER}[TOOL_CALLS]get_time{{"tz": "CET"}}',
         calls=[("get_weather", WEATHER), ("get_time", '{"tz": "CET"}')]),
    Case("v11_text_before", f"Let me see.[TOOL_CALLS]get_weather{WEATHER}", content="Let me see.",
         calls=[("get_weather", WEATHER)]),
    Case("v13_args_marker", f"[TOOL_CALLS]get_weather[ARGS]{WEATHER}", calls=[("get_weather", WEATHER)]),
    Case("call_id_marker", f"[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{WEATHER}",
         calls=[("get_weather", WEATHER)]),
    Case("nested_escaped", f"[TOOL_CALLS]search{NESTED}", calls=[("search", NESTED)]),
    Case("non_ascii", f"[TOOL_CALLS]translate[ARGS]{UNICODE}", calls=[("translate", UNICODE)]),
    Case("empty_arguments", "[TOOL_CALLS]get_time{}", calls=[("get_time", "{}")]),
    Case("truncated_v11", '[TOOL_CALLS]get_weather{"city": "Par', calls=[("get_weather", '{"city": "Par"}')]),
    Case("truncated_v7_second_call", '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "argu',
         calls=[("a", '{"x": 1}')]),
    verbatim("truncated_marker", "Answer: 42[TOOL_CAL"),
    verbatim("malformed_not_json", "[TOOL_CALLS] not json at all"),
    Case("v11_name_without_arguments", "[TOOL_CALLS]get_time", calls=[("get_time", "{}")]),
    Case("v11_names_without_arguments",
         f"[TOOL_CALLS]get_time [TOOL_CALLS]get_time[ARGS][TOOL_CALLS]get_weather{WEATHER}",
         calls=[("get_time", "{}"), ("get_time", "{}"), ("get_weather", WEATHER)]),
    Case("v11_known_name_without_arguments", "Now.[TOOL_CALLS]get_time[ARGS]", content="Now.",
         calls=[("get_time", "{}")], tools=TOOLS),
    verbatim("v11_unknown_name_without_arguments", "[TOOL_CALLS]get_wea", tools=TOOLS),
    verbatim("v11_name_then_text", "[TOOL_CALLS]get_time now please"),
    Case("v11_broken_arguments", '[TOOL_CALLS]run{"code": "print("hi")"}[TOOL_CALLS]get_time{}',
         content='[TOOL_CALLS]run{"code": "print("hi")"}', calls=[("get_time", "{}")]),
    Case("v11_text_around_calls", 'Sure. [TOOL_CALLS]a{} mid [TOOL_CALLS]c{"x": 1} After.',
         content="Sure. mid After.", calls=[("a", "{}"), ("c", '{"x": 1}')]),
    Case("v11_whitespace_next_to_calls", 'Sure.\n[TOOL_CALLS]a[ARGS]{}\n[TOOL_CALLS]c[ARGS]{"x": 1}\n',
         content="Sure.", calls=[("a", "{}"), ("c", '{"x": 1}')]),
    Case("v7_junk_before_list", '[TOOL_CALLS]  junk [{"name": "add", "arguments": {"a": 1, "b": 2}}] trail',
         content="junk trail", calls=[("add", '{"a": 1, "b": 2}')]),
    Case("v7_words_before_list", 'Ok.[TOOL_CALLS]Calling [it]: [ {"name": "a", "arguments": {}}]',
         content="Ok.Calling [it]:", calls=[("a", "{}")]),
    verbatim("v7_junk_without_list", "[TOOL_CALLS] see [1] and [x"),
    verbatim("v7_junk_list_not_calls", '[TOOL_CALLS] x [{"a": 1}] y'),
    Case("malformed_then_good", "[TOOL_CALLS]oops, sorry[TOOL_CALLS]get_time{}",
         content="[TOOL_CALLS]oops, sorry", calls=[("get_time", "{}")]),
]

PYTHONIC = [
    verbatim("no_call", "Paris is sunny today."),
    verbatim("text_before_is_content", "Sure! [get_weather(city='Paris')]"),
    Case("single", "[get_weather(city='Paris', unit=\"celsius\")]", calls=[("get_weather", WEATHER)]),
    Case("parallel", "[get_weather(city='Paris', unit='celsius'), get_time(tz='CET')]",
         calls=[("get_weather", WEATHER), ("get_time", '{"tz": "CET"}')]),
    Case("nested_escaped",
         "[search(q='it\\'s \"quoted\" ]) ,', filters={'tags': ['a', 'b'], 'range': (1, 2.5)}, exact=False, "
         "limit=None, neg=-3)]",
         calls=[("search", '{"q": "it\'s \\"quoted\\" ]) ,", "filters": {"tags": ["a", "b"], "range": [1, 2.5]}, '
                           '"exact": false, "limit": null, "neg": -3}')]),
    Case("triple_quoted", '[run(code="""a = 1\nprint(\'x\')""", note=\'\')]',
         calls=[("run", '{"code": "a = 1\\nprint(\'x\')", "note": ""}')]),
    Case("non_ascii", "[translate(text='你好, wörld 👋', to=\"日本語\")]",
         calls=[("translate", '{"text": "你好, wörld 👋", "to": "日本語"}')]),
    Case("empty_arguments", "  [get_time()]", calls=[("get_time", "{}")]),
    Case("text_after", "[get_time()] Done.", content=" Done.", calls=[("get_time", "{}")]),
    Case("truncated_second_call", "[get_weather(city='Paris', unit='celsius'), get_time(tz='CE",
         calls=[("get_weather", WEATHER)]),
    Case("truncated_no_bracket", "[get_weather(city='Paris', unit='celsius')", calls=[("get_weather", WEATHER)]),
    verbatim("truncated_first_call", "[get_weather(city='Par"),
    verbatim("malformed_positional", "[get_weather('Paris')]"),
    Case("bad_sibling", "[a(x=1), b(y=undefined_name), c(z=1e999), d(w=b'x'), e(v=2)]",
         content=" b(y=undefined_name) c(z=1e999) d(w=b'x')", calls=[("a", '{"x": 1}'), ("e", '{"v": 2}')]),
    Case("bad_first_sibling", "[b(y=undefined_name), a(x=1)]", content="b(y=undefined_name)",
         calls=[("a", '{"x": 1}')]),
    verbatim("no_good_sibling", "[b(y=undefined_name), c('positional')] ok"),
    Case("bad_sibling_then_cut_off", "[b(1), a(x=1), c(z='", content="b(1)", calls=[("a", '{"x": 1}')]),
    verbatim("markdown_link", "[docs](https://example.com) say hi"),
    verbatim("plain_list", "[1, 2, 3] are numbers"),
]

LLAMA3 = [
    verbatim("no_call", "The capital of France is Paris."),
    Case("text_before", f'Let me look that up. {{"name": "get_weather", "parameters": {WEATHER}}}',
         content="Let me look that up.", calls=[("get_weather", WEATHER)]),
    Case("python_tag", f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}',
         calls=[("get_weather", WEATHER)]),
    Case("parallel", '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}',
         calls=[("a", '{"x": 1}'), ("b", "{}")]),
    Case("nested_escaped", f'{{"name": "search", "parameters": {NESTED}}}', calls=[("search", NESTED)]),
    Case("non_ascii", f'{{"name": "translate", "parameters": {UNICODE}}}', calls=[("translate", UNICODE)]),
    Case("empty_arguments", '{"name": "get_time", "parameters": {}}', calls=[("get_time", "{}")]),
    Case("text_after", '{"name": "get_time", "parameters": {}}\nAnything else?', content="\nAnything else?",
         calls=[("get_time", "{}")]),
    Case("truncated", '{"name": "get_weather", "parameters": {"city": "Par',
         calls=[("get_weather", '{"city": "Par"}')]),
    verbatim("truncated_before_arguments", '{"name": "get_weather", "param'),
    verbatim("malformed_no_parameters", '{"name": "get_weather"}'),
    Case("bad_then_good", '{"name": "a"}; {"name": "b", "parameters": {}}', content='{"name": "a"};',
         calls=[("b", "{}")]),
    verbatim("json_in_prose", 'Use {"a": {"b": [1, 2]}} as config {curly}'),
    verbatim("malformed_builtin_tool", '<|python_tag|>brave_search.call(query="x")'),
]

GRANITE = [
    verbatim("no_call", "Granite says hello."),
    Case("text_before", f'I\'ll check.<|tool_call|>[{{"name": "get_weather", "arguments": {WEATHER}}}]',
         content="I'll check.", calls=[("get_weather", WEATHER)]),
    Case("parallel_v31", '<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]',
         calls=[("a", '{"x": 1}'), ("b", "{}")]),
    Case("bare_list", ' [{"name": "get_time", "arguments": {"tz": "CET"}}]', calls=[("get_time", '{"tz": "CET"}')]),
    Case("nested_escaped", f'<|tool_call|>[{{"name": "search", "arguments": {NESTED}}}]', calls=[("search", NESTED)]),
    Case("non_ascii", f'<|tool_call|>[{{"name": "translate", "arguments": {UNICODE}}}]',
         calls=[("translate", UNICODE)]),
    Case("empty_arguments", '<|tool_call|>[{"name": "get_time", "arguments": {}}]', calls=[("get_time", "{}")]),
    Case("text_after", '<|tool_call|>[{"name": "get_time", "arguments": {}}] ok', content=" ok",
         calls=[("get_time", "{}")]),
    Case("truncated", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_ti',
         calls=[("get_weather", '{"city": "Paris"}')]),
    verbatim("malformed", "<|tool_call|>not json"),
    verbatim("list_not_calls", "[1, 2] and more"),
]

JAMBA = [
    verbatim("no_call", "Jamba here."),
    Case("whitespace_prefix", f' <tool_calls>[{{"name": "get_weather", "arguments": {WEATHER}}}]</tool_calls>',
         calls=[("get_weather", WEATHER)]),
    Case("text_before", f'Checking.\n<tool_calls>[{{"name": "get_weather", "arguments": {WEATHER}}}]</tool_calls>',
         content="Checking.", calls=[("get_weather", WEATHER)]),
    Case("parallel",
         '<tool_calls>[\n {"name": "a", "arguments": {"x": 1}},\n {"name": "b", "arguments": {}}\n]</tool_calls>',
         calls=[("a", '{"x": 1}'), ("b", "{}")]),
    Case("nested_escaped", f'<tool_calls>[{{"name": "search", "arguments": {NESTED}}}]</tool_calls>',
         calls=[("search", NESTED)]),
    Case("non_ascii", f'<tool_calls>[{{"name": "translate", "arguments": {UNICODE}}}]</tool_calls>',
         calls=[("translate", UNICODE)]),
    Case("empty_arguments", '<tool_calls>[{"name": "get_time", "arguments": {}}]</tool_calls>',
         calls=[("get_time", "{}")]),
    Case("text_after", '<tool_calls>[{"name": "get_time", "arguments": {}}]</tool_calls> Thanks!', content=" Thanks!",
         calls=[("get_time", "{}")]),
    Case("truncated", '<tool_calls>[{"name": "get_weather", "arguments": {"city": "Pa',
         calls=[("get_weather", '{"city": "Pa"}')]),
    verbatim("malformed", "<tool_calls>[oops]</tool_calls> sorry"),
]

INTERNLM = [
    verbatim("no_call", "InternLM answers directly.", tools=TOOLS),
    Case("text_before", f'I will check.<|action_start|><|plugin|>\n{{"name": "get_weather", "parameters": {WEATHER}}}'
                        '<|action_end|>', content="I will check.", calls=[("get_weather", WEATHER)], tools=TOOLS),
    Case("parallel", '<|action_start|><|plugin|>{"name": "get_time", "parameters": {}}<|action_end|>\n'
                     '<|action_start|><|plugin|>{"name": "search", "parameters": {"q": "x"}}<|action_end|>',
         calls=[("get_time", "{}"), ("search", '{"q": "x"}')], tools=TOOLS),
    Case("nested_escaped", f'<|action_start|><|plugin|>{{"name": "search", "parameters": {NESTED}}}<|action_end|>',
         calls=[("search", NESTED)], tools=TOOLS),
    Case("non_ascii", f'<|action_start|><|plugin|>{{"name": "translate", "arguments": {UNICODE}}}<|action_end|>',
         calls=[("translate", UNICODE)]),
    Case("empty_arguments", '<|action_start|><|plugin|>{"name": "get_time", "parameters": {}}<|action_end|>',
         calls=[("get_time", "{}")], tools=TOOLS),
    Case("truncated", '<|action_start|><|plugin|>\n{"name": "search", "parameters": {"q": "wea',
         calls=[("search", '{"q": "wea"}')], tools=TOOLS),
    verbatim("unknown_tool", '<|action_start|><|plugin|>{"name": "rm_rf", "parameters": {}}<|action_end|>',
             tools=TOOLS),
    verbatim("malformed", "<|action_start|><|plugin|>oops<|action_end|>"),
]

# The malformed-output rules, one table run through every JSON parser: (id, call object,
# expected call or None). None means "not a call": the whole output is content, verbatim.
OPEN = {"hermes": "<tool_call>\n", "mistral": "[TOOL_CALLS] [", "llama3_json": "<|python_tag|>",
        "granite": "<|tool_call|>[", "jamba": "<tool_calls>[", "internlm": "<|action_start|><|plugin|>"}
CLOSE = {"hermes": "\n</tool_call>", "mistral": "]", "llama3_json": "", "granite": "]", "jamba": "]</tool_calls>",
         "internlm": "<|action_end|>"}
OPEN["phi4_mini_json"], CLOSE["phi4_mini_json"] = "functools[", "]"
LISTS = ("hermes", "mistral", "granite", "jamba", "phi4_mini_json")  # formats whose region may hold a list of calls
GOOD_A, GOOD_C = '{"name": "a", "arguments": {}}', '{"name": "c", "arguments": {"x": 1}}'
RULES = [
    ("rule_valid", '{"name": "f", "arguments": {"a": 1}}', ("f", '{"a": 1}')),
    ("rule_arguments_first", '{"arguments": {"a": [1]}, "name": "f"}', ("f", '{"a": [1]}')),
    ("rule_arguments_string_object", '{"name": "f", "arguments": "{\\"a\\": 1}"}', ("f", '{"a": 1}')),
    ("rule_no_arguments", '{"name": "f"}', None),
    ("rule_arguments_null", '{"name": "f", "arguments": null}', None),
    ("rule_arguments_list", '{"name": "f", "arguments": [1]}', None),
    ("rule_arguments_string_not_object", '{"name": "f", "arguments": "a=1"}', None),
    ("rule_no_name", '{"arguments": {"a": 1}}', None),
    ("rule_empty_name", '{"name": "", "arguments": {}}', None),
    ("rule_name_not_string", '{"name": ["f"], "arguments": {}}', None),
    ("rule_broken_in_arguments", '{"name": "f", "arguments": {"a": 1, "b": }}', None),
    ("rule_unescaped_quote", '{"name": "run", "arguments": {"code": "print("hi")"}}', None),
    ("rule_single_quotes", "{'name': 'f', 'arguments': {}}", None),
    ("rule_trailing_comma", '{"name": "f", "arguments": {"a": 1},}', None),
]


def rule_cases(parser: str) -> list[Case]:
    """The shared rules in ``parser``'s format: malformed calls, cut-off calls, text around
    calls, and (for list formats) bad siblings."""
    wrap = OPEN[parser] + "{}" + CLOSE[parser]
    out = []
    for rid, obj, call in RULES:
        text = OPEN[parser] + obj + CLOSE[parser]
        out.append(Case(rid, text, calls=[call]) if call else verbatim(rid, text))
    cut = OPEN[parser] + '{"name": "f", "arguments": {"a": 1, "b": "x'
    if parser == "hermes":  # an open <tool_call> cut off inside its JSON is content (hermes' rule)
        out.append(verbatim("rule_cut_off_in_arguments", cut))
    else:
        out.append(Case("rule_cut_off_in_arguments", cut, calls=[("f", '{"a": 1, "b": "x"}')]))
    cut = OPEN[parser] + '{"arguments": {"a": 1}, "na'
    out.append(verbatim("rule_cut_off_before_name", cut))
    if CLOSE[parser].strip("]"):  # an end marker before the object closed: malformed, not cut off
        text = OPEN[parser] + '{"name": "f", "arguments": {"a": 1}' + CLOSE[parser].lstrip("]")
        out.append(verbatim("rule_end_marker_inside_object", text))
    text = "Before. " + wrap.format(GOOD_A) + " mid " + wrap.format(GOOD_C) + " After."
    both = [("a", "{}"), ("c", '{"x": 1}')]
    out.append(Case("rule_text_around_calls", text, content="Before. mid After.", calls=both))
    text = "Before.\n\n" + wrap.format(GOOD_A) + "\n\n" + wrap.format(GOOD_C) + "\n"
    out.append(Case("rule_whitespace_next_to_calls", text, content="Before.", calls=both))
    if parser in LISTS:
        listed = ("[" if parser == "hermes" else "") + "{}" + ("]" if parser == "hermes" else "")
        in_list = OPEN[parser] + listed + CLOSE[parser]
        out += [
            Case("rule_bad_sibling", in_list.format(f'{GOOD_A}, {{"name": "b"}}, {GOOD_C}'), content=' {"name": "b"}',
                 calls=[("a", "{}"), ("c", '{"x": 1}')]),
            Case("rule_bad_first_sibling", in_list.format(f'{{"name": 7, "arguments": {{}}}}, {GOOD_C}'),
                 content='{"name": 7, "arguments": {}}', calls=[("c", '{"x": 1}')]),
            verbatim("rule_no_good_sibling", in_list.format('{"name": "b"}, {"x": 1}')),
        ]
        text = in_list.format(f'{GOOD_A}, {{"name": "b", "arguments": {{"y": ]}}}}, {GOOD_C}')
        rest = text[text.index('{"name": "b"'):]
        end_marker = CLOSE[parser].lstrip("]")  # dropped; the rest of the region is content
        rest = rest[:len(rest) - len(end_marker)]
        out.append(Case("rule_broken_sibling_ends_the_list", text, content=rest, calls=[("a", "{}")]))
    return out


RULE_CASES = {name: rule_cases(name) for name in OPEN}

TOOL_CASES = {"hermes": HERMES, "mistral": MISTRAL, "pythonic": PYTHONIC, "llama3_json": LLAMA3,
              "granite": GRANITE, "jamba": JAMBA, "internlm": INTERNLM}
TOOL_CASES.update(FAMILY_TOOL_CASES)
for _name, _cases in RULE_CASES.items():
    TOOL_CASES[_name] = TOOL_CASES[_name] + _cases
for _name, _cases in TOOL_CASES.items():
    for _case in _cases:
        _case.tool_parser = _name

R1 = "deepseek_r1"
REASONING_CASES = [
    Case("r1_complete", "<think>\nLet me think.\n</think>\n\nThe answer is 4.", reasoning="\nLet me think.\n",
         content="\n\nThe answer is 4.", reasoning_parser=R1),
    Case("r1_no_start_tag", "2 + 2 is 4.</think>It is 4.", reasoning="2 + 2 is 4.", content="It is 4.",
         reasoning_parser=R1),
    Case("r1_truncated", "<think>Still thinking about", reasoning="Still thinking about", reasoning_parser=R1),
    Case("r1_absent", "Just an answer.", reasoning="Just an answer.", reasoning_parser=R1),
    Case("r1_empty", "", reasoning_parser=R1),
    Case("r1_empty_content", "<think>x</think>", reasoning="x", reasoning_parser=R1),
    Case("r1_end_only", "</think>Answer", content="Answer", reasoning_parser=R1),
    Case("r1_partial_end_tag", "thinking </thi", reasoning="thinking </thi", reasoning_parser=R1),
    Case("r1_leading_whitespace", "\n <think>x</think>y", reasoning="x", content="y", reasoning_parser=R1),
    Case("r1_second_end_tag", "a</think>b</think>c", reasoning="a", content="b</think>c", reasoning_parser=R1),
    Case("r1_non_ascii", "<think>思考中…</think>答案是 4。", reasoning="思考中…", content="答案是 4。",
         reasoning_parser=R1),
    Case("qwen3_complete", "<think>\nhmm\n</think>\n\nHello!", reasoning="\nhmm\n", content="\n\nHello!",
         reasoning_parser="qwen3"),
    Case("qwen3_prompt_think", "hmm</think>\n\nHello!", reasoning="hmm", content="\n\nHello!",
         reasoning_parser="qwen3"),
    Case("qwen3_truncated", "<think>\nlong thought", reasoning="\nlong thought", reasoning_parser="qwen3"),
    Case("qwen3_absent", "Hello!", reasoning="Hello!", reasoning_parser="qwen3"),
    verbatim("qwen3_disabled", "Hello! <think> is a tag.", reasoning_parser="qwen3",
             template_kwargs={"enable_thinking": False}),
    Case("qwen3_disabled_with_tags", "<think>\n\n</think>\n\nHello!", reasoning="\n\n", content="\n\nHello!",
         reasoning_parser="qwen3", template_kwargs={"enable_thinking": False}),
    Case("qwen3_enabled_explicitly", "hmm</think>ok", reasoning="hmm", content="ok", reasoning_parser="qwen3",
         template_kwargs={"enable_thinking": True}),
    Case("qwen3_implicit_end_function", "I need the tool.\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
         reasoning="I need the tool.\n", content="<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
         reasoning_parser="qwen3"),
    Case("qwen3_tool_call_mentioned", "Use the <tool_call> tag later.</think>ok",
         reasoning="Use the <tool_call> tag later.", content="ok", reasoning_parser="qwen3"),
    Case("qwen3_tool_call_tag_at_end", "thinking <tool_call>", reasoning="thinking <tool_call>",
         reasoning_parser="qwen3"),
    # Reasoning, then a tool call: the tool parser sees only what follows the thinking.
    Case("chain_qwen3_hermes",
         "<think>\nI should call get_time.\n</think>\n\n" + hermes_block("get_time", '{"tz": "CET"}'),
         reasoning="\nI should call get_time.\n", calls=[("get_time", '{"tz": "CET"}')], reasoning_parser="qwen3",
         tool_parser="hermes"),
    Case("chain_qwen3_hermes_call_inside_think", "I will call it.\n" + hermes_block("get_time", "{}"),
         reasoning="I will call it.\n", calls=[("get_time", "{}")], reasoning_parser="qwen3", tool_parser="hermes"),
    Case("chain_call_in_reasoning_is_not_parsed", '<think>maybe {"name": "x", "parameters": {}}</think>Answer.',
         reasoning='maybe {"name": "x", "parameters": {}}', content="Answer.", reasoning_parser=R1,
         tool_parser="llama3_json"),
    Case("chain_r1_mistral", "<think>weather?</think>[TOOL_CALLS]get_weather{\"city\": \"Paris\"}",
         reasoning="weather?", calls=[("get_weather", '{"city": "Paris"}')], reasoning_parser=R1,
         tool_parser="mistral"),
    Case("chain_r1_pythonic", "<think>ok</think>\n\n[get_time(tz='CET')]", reasoning="ok",
         calls=[("get_time", '{"tz": "CET"}')], reasoning_parser=R1, tool_parser="pythonic"),
    Case("chain_qwen3_disabled_hermes", "Sure.\n" + hermes_block("get_time", "{}"), content="Sure.",
         calls=[("get_time", "{}")], reasoning_parser="qwen3", tool_parser="hermes",
         template_kwargs={"enable_thinking": False}),
    Case("chain_truncated_reasoning", "<think>I will call get_ti", reasoning="I will call get_ti",
         reasoning_parser="qwen3", tool_parser="hermes"),
]

ALL_TOOL_CASES = [case for cases in TOOL_CASES.values() for case in cases]
ALL_CASES = ALL_TOOL_CASES + REASONING_CASES + XML_CASES + FAMILY_REASONING


def case_id(case: Case) -> str:
    return f"{case.tool_parser or '-'}+{case.reasoning_parser or '-'}:{case.id}"
