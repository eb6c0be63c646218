"""llmserve.guided without a model: the spec, decoder choice, laziness, the LRU, failures."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from llmserve.errors import GenerationError, InvalidRequestError
from llmserve.guided import GuidedDecoding, GuidedSpec
from llmserve.hooks.manager import PluginManager
from llmserve.hooks.registry import Registry

TOY = str(Path(__file__).resolve().parent / "toy_decoder.py")


def make(tmp_path=None, extra: str = "", backend: str = "lm-format-enforcer", **kw) -> GuidedDecoding:
    specs = [(TOY, "cli")]
    if extra:
        path = tmp_path / "extra_decoders.py"
        path.write_text(textwrap.dedent(extra))
        specs.append((str(path), "cli"))
    registry = Registry.collect(PluginManager().load(specs, autoload=False))
    return GuidedDecoding(registry, backend, tokenizer=None, vocab_size=257, eos_token_ids=[256], **kw)


def test_spec_kind_and_canonical_key():
    with pytest.raises(ValueError, match="unknown guided-decoding kind 'yaml'"):
        GuidedSpec("yaml", "x")
    a = GuidedSpec("json_schema", {"b": 1, "a": [1, {"y": 2, "x": 1}]}, param="guided_json")
    b = GuidedSpec("json_schema", {"a": [1, {"x": 1, "y": 2}], "b": 1}, param="response_format")
    assert a.cache_key() == b.cache_key() == ("json_schema", '{"a":[1,{"x":1,"y":2}],"b":1}')


def test_choice_laziness_and_lru():
    guided = make(cache_size=2)
    toy = sys.modules["llmserve_plugin_toy_decoder"]
    toy.BUILT.clear()
    assert guided.decoder_name("grammar") == "toy-literal"
    assert guided.decoder_name("json_schema") == "lm-format-enforcer"
    assert toy.BUILT == []  # choosing imports the class; nothing is built until a compile
    a = guided.compile(GuidedSpec("grammar", "a", param="guided_grammar"))
    assert guided.compile(GuidedSpec("grammar", "a")) is a
    b = guided.compile(GuidedSpec("grammar", "b"))
    assert guided.compile(GuidedSpec("grammar", "a")) is a  # a is now the most recent
    guided.compile(GuidedSpec("grammar", "c"))                # evicts b
    assert guided.compile(GuidedSpec("grammar", "a")) is a
    assert guided.compile(GuidedSpec("grammar", "b")) is not b
    assert toy.BUILT == ["toy-literal"]
    mask = a()
    assert mask.allowed([]) == [ord("a")] and mask.allowed([ord("a")]) == [256]


def test_installed_and_missing_kind_message(tmp_path):
    guided = make(tmp_path, """
        from llmserve import hookimpl
        from llmserve.hooks.records import GuidedDecoderSpec

        @hookimpl
        def register_guided_decoders():
            return [GuidedDecoderSpec(name="broken", target="no_such_module_xyz:Decoder")]
    """)
    kinds = frozenset({"json_schema", "json_object", "regex", "choice", "structure"})
    assert guided.installed() == [("lm-format-enforcer", kinds), ("broken", None),
                                  ("toy-literal", frozenset({"grammar"}))]
    guided.registry.kinds["guided_decoder"].pop("toy-literal")
    with pytest.raises(InvalidRequestError) as info:
        guided.compile(GuidedSpec("grammar", "x", param="guided_grammar"))
    assert info.value.message.endswith("installed: lm-format-enforcer (json_schema, json_object, regex, choice, "
                                       "structure), broken (failed to load)")


def test_none_installed():
    registry = Registry.collect(PluginManager().load([("no:lm-format-enforcer", "cli")], autoload=False))
    guided = GuidedDecoding(registry, "lm-format-enforcer", None, 10, [0])
    with pytest.raises(InvalidRequestError, match="JSON-schema-guided decoding needs a guided-decoding plugin "
                                                  "that supports JSON schemas; installed: none"):
        guided.compile(GuidedSpec("json_schema", {}, param="guided_json"))


def test_decoder_that_fails_to_start_is_a_500_once(tmp_path):
    guided = make(tmp_path, """
        from llmserve import hookimpl
        from llmserve.hooks.records import GuidedDecoderSpec
        from llmserve.guided import GuidedDecoder

        CALLS = []

        class Grumpy(GuidedDecoder):
            kinds = frozenset({"grammar"})
            def __init__(self, tokenizer, vocab_size, eos_token_ids):
                CALLS.append(1)
                raise RuntimeError("no GPU for grammars")
            def compile(self, spec):
                raise AssertionError

        @hookimpl
        def register_guided_decoders():
            return [GuidedDecoderSpec(name="grumpy", target=__name__ + ":Grumpy")]
    """, backend="grumpy")
    for _ in range(2):
        with pytest.raises(GenerationError, match="guided decoder 'grumpy' failed to start: RuntimeError: no GPU"):
            guided.compile(GuidedSpec("grammar", "x"))
    assert sys.modules["llmserve_plugin_extra_decoders"].CALLS == [1]
