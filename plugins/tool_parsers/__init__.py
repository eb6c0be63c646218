"""Built-in tool-call and reasoning parser plugins.

Only records are built here; each parser module is imported when a parser is first used, so
``llmserve plugins`` stays import-light. Formats and decisions: docs/tool-calling.md.
"""

from llmserve import hookimpl
from llmserve import ReasoningParserSpec, ToolParserSpec

_PKG = "llmserve.plugins.tool_parsers"


@hookimpl
def register_tool_parsers():
    return [
        ToolParserSpec(name="hermes", target=f"{_PKG}.hermes:HermesToolParser",
                       template_markers=("<tool_call>",),
                       description="<tool_call>{json}</tool_call> (Hermes 2 Pro, Qwen2.5/3)"),
        ToolParserSpec(name="mistral", target=f"{_PKG}.mistral:MistralToolParser",
                       template_markers=("[TOOL_CALLS]",),
                       description="[TOOL_CALLS] [json], [TOOL_CALLS]name{json}, name[ARGS]{json}"),
        ToolParserSpec(name="pythonic", target=f"{_PKG}.pythonic:PythonicToolParser",
                       description="[name(kw=literal), ...] (Llama 3.2, ToolACE, Gemma 3)"),
        ToolParserSpec(name="llama3_json", target=f"{_PKG}.llama3_json:Llama3JsonToolParser",
                       aliases=("llama4_json",),
                       template_markers=("Environment: ipython",),
                       description="<|python_tag|>{\"name\", \"parameters\"}; ... (Llama 3.1+/4)"),
        ToolParserSpec(name="granite", target=f"{_PKG}.granite:GraniteToolParser",
                       template_markers=("<|tool_call|>",),
                       description="<|tool_call|>[json, ...] (Granite 3.0/3.1)"),
        ToolParserSpec(name="jamba", target=f"{_PKG}.jamba:JambaToolParser",
                       template_markers=("<tool_calls>",),
                       description="<tool_calls>[json, ...]</tool_calls> (Jamba 1.5)"),
        ToolParserSpec(name="internlm", target=f"{_PKG}.internlm:InternLMToolParser",
                       template_markers=("<|action_start|>", "<|plugin|>"),
                       description="<|action_start|><|plugin|>{json}<|action_end|> (InternLM 2.5)"),
        ToolParserSpec(name="qwen3_coder", target=f"{_PKG}.qwen3_coder:Qwen3CoderToolParser", aliases=("qwen3_xml",),
                       template_markers=("<tool_call>", "<function="),
                       description="<tool_call><function=N><parameter=K>V</parameter></function> (Qwen3-Coder, 3.5)"),
        ToolParserSpec(name="glm45", target=f"{_PKG}.glm45:Glm45ToolParser",
                       template_markers=("<tool_call>", "<arg_key>"),
                       description="<tool_call>N<arg_key>K</arg_key><arg_value>V</arg_value> (GLM-4.5/4.6)"),
        ToolParserSpec(name="glm47", target=f"{_PKG}.glm45:Glm45ToolParser",
                       template_markers=("<tool_call>", "<arg_key>", "</arg_key><arg_value>"),
                       description="<tool_call>N<arg_key>K</arg_key><arg_value>V</arg_value> (GLM-4.7)"),
        ToolParserSpec(name="minimax_m2", target=f"{_PKG}.minimax_m2:MiniMaxM2ToolParser",
                       template_markers=("<minimax:tool_call>",),
                       description="<minimax:tool_call><invoke name=N><parameter name=K>V (MiniMax-M2)"),
        ToolParserSpec(name="seed_oss", target=f"{_PKG}.seed_oss:SeedOssToolParser",
                       template_markers=("<seed:tool_call>",),
                       description="<seed:tool_call><function=N><parameter=K>V</parameter> (Seed-OSS)"),
        ToolParserSpec(name="openai", target=f"{_PKG}.harmony:OpenAIToolParser",
                       template_markers=("<|channel|>", "<|call|>"),
                       description="harmony <|channel|>commentary to=functions.N<|message|>{json}<|call|> (gpt-oss)"),
        ToolParserSpec(name="kimi_k2", target=f"{_PKG}.kimi_k2:KimiK2ToolParser",
                       template_markers=("<|tool_calls_section_begin|>",),
                       description="<|tool_call_begin|>functions.N:0<|tool_call_argument_begin|>{json} (Kimi-K2)"),
        ToolParserSpec(name="deepseek_v3", target=f"{_PKG}.deepseek:DeepSeekV3ToolParser",
                       template_markers=("<｜tool▁calls▁begin｜>", "```json"),
                       description="<｜tool▁call▁begin｜>function<｜tool▁sep｜>N ```json {json}``` (DeepSeek-V3)"),
        ToolParserSpec(name="deepseek_v31", target=f"{_PKG}.deepseek:DeepSeekV31ToolParser",
                       template_markers=("<｜tool▁calls▁begin｜>",),
                       description="<｜tool▁call▁begin｜>N<｜tool▁sep｜>{json} (DeepSeek-V3.1/V3.2)"),
        ToolParserSpec(name="phi4_mini_json", target=f"{_PKG}.phi4_mini:Phi4MiniJsonToolParser",
                       template_markers=("<|tool|>", "<|/tool|>"),
                       description="functools[json, ...] (Phi-4-mini)"),
        ToolParserSpec(name="lfm2", target=f"{_PKG}.lfm2:Lfm2ToolParser",
                       template_markers=("<|im_start|>", "<|tool_"),
                       description="<|tool_call_start|>[name(k=v), ...]<|tool_call_end|> (LFM2, LFM2.5)"),
    ]


@hookimpl
def register_reasoning_parsers():
    return [
        ReasoningParserSpec(name="deepseek_r1", target=f"{_PKG}.reasoning:DeepSeekR1ReasoningParser",
                            template_markers=("<｜Assistant｜>", "<think>"),
                            description="<think>...</think>; no </think> means all reasoning"),
        ReasoningParserSpec(name="qwen3", target=f"{_PKG}.reasoning:Qwen3ReasoningParser",
                            template_markers=("<|im_start|>", "<think>", "enable_thinking"),
                            description="<think>...</think>; honours enable_thinking"),
        ReasoningParserSpec(name="glm45", target=f"{_PKG}.reasoning:Glm45ReasoningParser",
                            template_markers=("<arg_key>", "<think>", "enable_thinking"),
                            description="<think>...</think> (GLM-4.5/4.6/4.7); honours enable_thinking"),
        ReasoningParserSpec(name="minimax_m2", target=f"{_PKG}.reasoning:DeepSeekR1ReasoningParser",
                            template_markers=("<minimax:tool_call>", "<think>"),
                            description="<think>...</think>; output starts inside the thinking"),
        ReasoningParserSpec(name="seed_oss", target=f"{_PKG}.reasoning:SeedOssReasoningParser",
                            template_markers=("<seed:think>",),
                            description="<seed:think>...</seed:think> (Seed-OSS); only when the output opens it"),
        ReasoningParserSpec(name="openai_gptoss", target=f"{_PKG}.harmony:OpenAIGptOssReasoningParser",
                            template_markers=("<|channel|>", "analysis"),
                            description="harmony analysis channel (gpt-oss); calls passed on to the openai parser"),
        ReasoningParserSpec(name="kimi_k2", target=f"{_PKG}.reasoning_families:KimiK2ReasoningParser",
                            template_markers=("<|tool_calls_section_begin|>", "<think>"),
                            description="<think>...</think> when the output opens it; a tool-call section ends it"),
        ReasoningParserSpec(name="deepseek_v3", target=f"{_PKG}.reasoning_families:DeepSeekV3ReasoningParser",
                            template_markers=("<｜Assistant｜>", "<think></think>"),
                            description="<think>...</think> (DeepSeek-V3.1/V3.2); honours thinking"),
        ReasoningParserSpec(name="mistral", target=f"{_PKG}.reasoning_families:MistralReasoningParser",
                            template_markers=("[THINK]",),
                            description="[THINK]...[/THINK] (Magistral)"),
        ReasoningParserSpec(name="granite", target=f"{_PKG}.reasoning_families:GraniteReasoningParser",
                            template_markers=("Here is my thought process:",),
                            description="Here is my thought process: ... Here is my response: (Granite 3.2)"),
    ]
