"""Which files of a repo listing are fetched and served, and the refusals, from the listing alone."""

from __future__ import annotations

import pytest

from llmserve.errors import ConfigError
from llmserve.models.ref import ModelRef, parse_ref
from llmserve.models.select import quant_of, select_files

SAFE = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
        "pytorch_model.bin", "README.md", ".gitattributes", "original/consolidated.safetensors", "train.py"]


def test_a_safetensors_listing_keeps_config_tokenizer_template_and_weights():
    sel = select_files(ModelRef("org/m"), SAFE)
    assert sel.kind == "safetensors" and sel.serve == ""
    assert sel.files == sorted(["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                                "chat_template.jinja", "model-00001-of-00002.safetensors",
                                "model-00002-of-00002.safetensors", "model.safetensors.index.json"])


@pytest.mark.parametrize("names, message", [
    (["config.json", "model.bin", "model.pth"], "has only pickled weights"),
    (["config.json", "README.md"], "holds no model weights llmserve serves"),
    (["model.safetensors"], "has safetensors but no config.json"),
    (["mmproj-f16.gguf"], "holds no GGUF model, only vision projectors"),
    (["m-00001-of-00003.gguf", "m-00003-of-00003.gguf"], "split GGUF m has 2 of its 3 parts"),
    (["config.json", "../x.safetensors"], "climbs out of its folder"),
])
def test_refusals(names, message):
    with pytest.raises(ConfigError, match=message):
        select_files(ModelRef("org/m"), names)


def test_a_quant_on_a_safetensors_repo_says_how_to_name_it():
    with pytest.raises(ConfigError, match=r"org/m holds safetensors, not GGUF files: serve it as org/m \(no :QUANT\)"):
        select_files(ModelRef("org/m", "Q4_K_M"), SAFE)


def test_quant_tokens_do_not_match_inside_longer_quants():
    names = ["m-Q4_K_S.gguf", "m-Q4_K_M.gguf", "m-IQ4_XS.gguf", "Q8_0/m-Q8_0-00001-of-00002.gguf",
             "Q8_0/m-Q8_0-00002-of-00002.gguf"]
    assert select_files(ModelRef("org/m", "Q4_K"), names + ["m-Q4_K.gguf"]).serve == "m-Q4_K.gguf"
    with pytest.raises(ConfigError, match="it has IQ4_XS, Q4_K_M, Q4_K_S, Q8_0"):
        select_files(ModelRef("org/m", "Q4_K"), names)
    split = select_files(ModelRef("org/m", "q8_0"), names)
    assert split.files == ["Q8_0/m-Q8_0-00001-of-00002.gguf", "Q8_0/m-Q8_0-00002-of-00002.gguf"]
    assert select_files(ModelRef("org/m"), names).serve == "m-Q4_K_M.gguf"
    assert [quant_of(n) for n in names[:3]] == ["Q4_K_S", "Q4_K_M", "IQ4_XS"]


def test_ref_spellings():
    assert parse_ref("hf.co/Org/Model-GGUF:UD-Q4_K_XL") == ModelRef("Org/Model-GGUF", "UD-Q4_K_XL")
    assert parse_ref("huggingface.co/a/b").name == "a/b"
    for bad in ("a/b:", "a/b:c:d", "a/b/c", "a--b/c", "a/b..c", "/a/b", "a/b:Q4/..", "a b/c"):
        assert parse_ref(bad) is None, bad
