"""``--tool-call-parser auto`` / ``--reasoning-parser auto`` (llmserve.parsing.detect): the real chat
templates of the families in tests/parsers/templates/ map to their parsers, unknown ones to none,
and no template input breaks detection."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

from conftest import run_cli
from llmserve.hooks.manager import PluginManager
from llmserve.hooks.registry import Registry
from llmserve.parsing.detect import MAX_TEMPLATE_CHARS, detect_parsers, probe_turns, template_text
from llmserve.text.model_template import read_model_template

from .helpers import registry

TEMPLATES = Path(__file__).parent / "templates"

# template file -> (tool-call parser, reasoning parser): what each family's own template points at.
FAMILIES = {
    "qwen3.jinja": ("hermes", "qwen3"),
    "qwen3-coder.jinja": ("qwen3_coder", None),
    "qwen3.5.jinja": ("qwen3_coder", "qwen3"),
    "qwen2.5.jinja": ("hermes", None),
    "hermes-3.jinja": ("hermes", None),
    "gpt-oss.jinja": ("openai", "openai_gptoss"),
    "glm-4.6.jinja": ("glm45", "glm45"),
    "glm-4.7-flash.jinja": ("glm47", "glm45"),
    "kimi-k2.jinja": ("kimi_k2", None),
    "kimi-k2-thinking.jinja": ("kimi_k2", "kimi_k2"),
    "deepseek-r1-distill-qwen.jinja": ("deepseek_v3", "deepseek_r1"),
    "deepseek-v3.1.jinja": ("deepseek_v31", "deepseek_v3"),
    "minimax-m2.jinja": ("minimax_m2", "minimax_m2"),
    "seed-oss.jinja": ("seed_oss", "seed_oss"),
    "phi-4-mini.jinja": ("phi4_mini_json", None),
    "lfm2.jinja": ("lfm2", None),
    "mistral-small-3.2.jinja": ("mistral", None),
    "ministral-3-reasoning.jinja": ("mistral", "mistral"),
    "granite-3.3.jinja": ("granite", None),
    "llama-3.1.jinja": ("llama3_json", None),
    "llama-3.2.jinja": ("llama3_json", None),
    # No format a parser here reads: Gemma 2 has no tools; functionary writes <function=NAME>{json}
    # (its template has Llama's markers, and the probe shows llama3_json cannot read its calls).
    "gemma-2.jinja": (None, None),
    "functionary-v3.1.jinja": (None, None),
}

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_every_stored_template_is_listed():
    assert sorted(p.name for p in TEMPLATES.glob("*.jinja")) == sorted(FAMILIES)
    assert len({tool for tool, _ in FAMILIES.values() if tool}) >= 12


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_familys_template_maps_to_its_parsers(name):
    found = detect_parsers((TEMPLATES / name).read_text(encoding="utf-8"), registry())
    assert (found.tool.name, found.reasoning.name) == FAMILIES[name], found.lines()
    assert found.tool.evidence and found.reasoning.evidence


@pytest.mark.parametrize("name, shown", [
    ("qwen3-coder.jinja", "<function=get_weather>"),
    ("gpt-oss.jinja", "to=functions.get_weather"),
    ("deepseek-v3.1.jinja", "get_weather<｜tool▁sep｜>"),
])
def test_the_evidence_quotes_the_rendered_call_and_the_markers(name, shown):
    tool = detect_parsers((TEMPLATES / name).read_text(encoding="utf-8"), registry()).tool
    assert "markers" in tool.evidence and shown in tool.evidence and "reads back" in tool.evidence


def test_a_template_that_renders_no_past_call_is_judged_by_its_markers():
    # Granite 3.3's template drops an assistant turn's tool_calls: the probe shows nothing.
    template = (TEMPLATES / "granite-3.3.jinja").read_text(encoding="utf-8")
    assert not [t for t in probe_turns(template) if "get_weather" in t]
    assert "renders no probe call" in detect_parsers(template, registry()).tool.evidence


def test_the_most_specific_markers_win():
    # qwen3_coder's <function= inside <tool_call> beats hermes' <tool_call>; deepseek_v3's fenced
    # JSON beats deepseek_v31; glm47's unbroken tags beat glm45: every one also fits the shorter set.
    for name, loser in (("qwen3-coder.jinja", "hermes"), ("deepseek-r1-distill-qwen.jinja", "deepseek_v31"),
                        ("glm-4.7-flash.jinja", "glm45")):
        from llmserve.parsing.detect import ranked

        names = [n for n, _ in ranked((TEMPLATES / name).read_text(encoding="utf-8"), registry(), "tool_parser")]
        assert names.index(FAMILIES[name][0]) < names.index(loser), (name, names)


@pytest.mark.parametrize("template", [CHATML, "", None, "{{ messages }}"])
def test_an_unknown_template_maps_to_none(template):
    found = detect_parsers(template, registry())
    assert (found.tool.name, found.reasoning.name) == (None, None)


@pytest.mark.parametrize("template", [
    "{% for m in messages %}",                                            # a syntax error
    "<tool_call>{% for i in range(10**9) %}x{% endfor %}",                 # renders for ever
    "<tool_call>{{ raise_exception('no') }}",                              # raises
    "<tool_call>{{ ''.__class__.__mro__ }}",                               # sandbox
    "<tool_call>{{ 'x' * 10**9 }}",                                        # huge output
    "<tool_call>" + "{% if true %}" * 200 + "x" + "{% endif %}" * 200,     # deep nesting
    "\x00\ud800<tool_call>\uffff",                                         # odd characters
    7, ["not", "a", "template"], {"default": 3},
])
def test_malformed_template_input_never_breaks_detection(template):
    started = time.monotonic()
    found = detect_parsers(template, registry())
    assert time.monotonic() - started < 15
    assert found.tool.name in (None, "hermes")  # markers alone when the probe cannot render


def test_a_huge_template_is_not_inspected():
    found = detect_parsers("<tool_call>" + " " * MAX_TEMPLATE_CHARS, registry())
    assert found.tool.name is None and "not inspected" in found.tool.evidence


def test_named_templates_use_the_tool_use_one():
    assert template_text([{"name": "default", "template": "a"}, {"name": "tool_use", "template": "b"}]) == "b"
    assert template_text({"default": "a", "rag": "c"}) == "a"
    assert template_text({"other": "c"}) == "c"


def test_a_plugin_parser_is_detected_from_its_declared_markers(tmp_path):
    plugin = tmp_path / "acme_parser.py"
    plugin.write_text(
        "from llmserve import hookimpl, ToolParserSpec\n"
        "@hookimpl\n"
        "def register_tool_parsers():\n"
        "    return [ToolParserSpec(name='acme', target='llmserve.plugins.tool_parsers.hermes:HermesToolParser',\n"
        "                           template_markers=('<tool_call>', '<acme>'))]\n", encoding="utf-8")
    pm = PluginManager().load(autoload=False)
    pm.load_spec(str(plugin), "test")
    template = (TEMPLATES / "qwen2.5.jinja").read_text(encoding="utf-8") + "<acme>"
    found = detect_parsers(template, Registry.collect(pm))
    assert found.tool.name == "acme" and '"<acme>"' in found.tool.evidence


def test_reading_templates_from_a_model_directory_and_a_gguf(tmp_path):
    import gguf

    coder = (TEMPLATES / "qwen3-coder.jinja").read_text(encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": coder, "bos_token": {"content": "<s>"}, "eos_token": "<|im_end|>"}), encoding="utf-8")
    assert read_model_template(str(tmp_path)) == (coder, {"bos_token": "<s>", "eos_token": "<|im_end|>"})
    (tmp_path / "chat_template.jinja").write_text(CHATML, encoding="utf-8")
    assert read_model_template(str(tmp_path))[0] == CHATML  # the file wins, as transformers reads it
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])  # an array before it: skipped, not decoded
    writer.add_chat_template(coder)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert read_model_template(str(tmp_path / "m.gguf")) == (coder, {})


def test_parse_detect_prints_the_parsers_and_the_evidence(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "chat_template.jinja").write_text((TEMPLATES / "glm-4.6.jinja").read_text(encoding="utf-8"),
                                               encoding="utf-8")
    proc = run_cli("parse", "--detect", str(model))
    assert proc.returncode == 0, proc.stderr
    tool, reasoning = proc.stdout.splitlines()
    assert tool.startswith("tool-call parser: glm45 (markers ") and "reads back" in tool
    assert reasoning.startswith("reasoning parser: glm45 (markers ")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 7)
    for path in (tmp_path / "missing", tmp_path / "bad.gguf"):
        proc = run_cli("parse", "--detect", str(path))
        assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr


def test_a_server_with_auto_tool_choice_and_no_parser_detects_it(echo_app, caplog):
    caplog.set_level(logging.INFO, logger="llmserve.parsing")
    client, context = echo_app(enable_auto_tool_choice=True, chat_template=str(TEMPLATES / "qwen3.5.jinja"),
                               max_model_len=4096)
    assert (context.parsing.tool_parser, context.parsing.reasoning_parser) == ("qwen3_coder", "qwen3")
    assert context.parsing.auto_tools
    lines = [r.getMessage() for r in caplog.records if r.name == "llmserve.parsing"]
    assert any(line.startswith("tool-call parser qwen3_coder, detected: markers") for line in lines), lines
    body = {"model": "echo", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text


def test_named_parsers_override_detection(echo_app):
    _, context = echo_app(enable_auto_tool_choice=True, tool_call_parser="hermes",
                          chat_template=str(TEMPLATES / "qwen3.5.jinja"))
    assert (context.parsing.tool_parser, context.parsing.reasoning_parser) == ("hermes", None)
    _, context = echo_app(reasoning_parser="auto", chat_template=str(TEMPLATES / "qwen3.5.jinja"),
                          enable_auto_tool_choice=False)
    assert (context.parsing.tool_parser, context.parsing.reasoning_parser) == (None, "qwen3")


TOOLS_BODY = {"model": "echo", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
              "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}


def test_tool_calling_is_on_by_default_where_the_template_shows_a_format(echo_app):
    """No tool flags: a template with a known tool-call format gets its parser and tool_choice
    auto (the reasoning parser stays as named); --no-enable-auto-tool-choice turns that off; a
    template without one answers auto with a 400 that says so."""
    qwen = str(TEMPLATES / "qwen3.5.jinja")
    client, context = echo_app(chat_template=qwen, max_model_len=4096)
    assert (context.parsing.tool_parser, context.parsing.reasoning_parser) == ("qwen3_coder", None)
    assert context.parsing.auto_tools
    assert client.post("/v1/chat/completions", json=TOOLS_BODY).status_code == 200
    client, context = echo_app(chat_template=qwen, max_model_len=4096, enable_auto_tool_choice=False)
    assert context.parsing.tool_parser is None and not context.parsing.auto_tools
    assert client.post("/v1/chat/completions", json=TOOLS_BODY).status_code == 400
    _, context = echo_app(tool_call_parser="hermes")  # a parser named: auto tool choice with it
    assert context.parsing.auto_tools and context.parsing.detection is None
    client, _ = echo_app(chat_template=CHATML)
    reply = client.post("/v1/chat/completions", json=TOOLS_BODY)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "tool_choice"
    assert "the model's chat template shows no tool-call format a parser here reads" in error["message"]
    assert "--tool-call-parser" in error["message"]
    anthropic = client.post("/v1/messages", json={"model": "m", "max_tokens": 8, "messages": TOOLS_BODY["messages"],
                                                  "tools": [{"name": "f", "input_schema": {"type": "object"}}]})
    assert anthropic.status_code == 400 and "shows no tool-call format" in anthropic.json()["error"]["message"]


def test_no_recognisable_format_leaves_tool_calls_off_with_one_line(echo_app, caplog):
    caplog.set_level(logging.INFO, logger="llmserve.parsing")
    client, context = echo_app(enable_auto_tool_choice=True, chat_template=CHATML)
    assert context.parsing.tool_parser is None and not context.parsing.auto_tools
    lines = [r.getMessage() for r in caplog.records if r.name == "llmserve.parsing"]
    assert len(lines) == 1 and lines[0].startswith("tool calls are off: no tool-call format was recognised")
    reply = client.post("/v1/chat/completions", json=TOOLS_BODY)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tool_choice"


def test_a_generated_tiny_model_with_a_family_template_gets_its_parser(tmp_path):
    """A real (tiny, random) Llama directory carrying gpt-oss's template, served by the torch
    backend with --enable-auto-tool-choice and no parser named."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from llmserve.config import load_config
    from llmserve.server.serve import build_server

    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                 eos_token_id=1, bos_token_id=0)).save_pretrained(tmp_path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", bos_token="t0").save_pretrained(
        tmp_path)
    (tmp_path / "chat_template.jinja").write_text((TEMPLATES / "gpt-oss.jinja").read_text(encoding="utf-8"),
                                                  encoding="utf-8")
    config, _ = load_config({"model": str(tmp_path), "dtype": "float32", "device": "cpu", "max_model_len": 128,
                             "enable_auto_tool_choice": True, "protocols": ["openai"]}, environ={})
    _, context = build_server(config, PluginManager().load(autoload=False))
    try:
        assert (context.parsing.tool_parser, context.parsing.reasoning_parser) == ("openai", "openai_gptoss")
        assert context.parsing.detection is not None and "<|call|>" in context.parsing.detection.tool.evidence
    finally:
        context.engine.shutdown()
