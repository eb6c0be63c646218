"""A GGUF model split into several files (llama.cpp's gguf-split layout, ``x-00001-of-0000N.gguf``)
is served as one model from its first part: the same logits as the same model in one file; a
later part, a missing part, and the fp32-conversion path are one-line refusals."""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from llmserve.errors import ConfigError
from llmserve.plugins.backends.torch.gguf_file import GGUFFile, GGUFHeaderError
from llmserve.plugins.backends.torch.loader import hf_directory

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
sys.path.insert(0, os.path.dirname(__file__))
import gguf_writer
from test_gguf_native import make_backend, native_logits, sequence

SHAPE = {"hidden": 64, "inter": 128, "heads": 2, "kv_heads": 1, "qtype": "Q8_0", "seed": 5}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("split")
    whole, split = str(folder / "whole.gguf"), str(folder / "tiny.gguf")
    gguf_writer.write_tiny_gguf(whole, **SHAPE)
    gguf_writer.write_tiny_gguf(split, split_max_tensors=7, **SHAPE)
    parts = sorted(str(p) for p in folder.glob("tiny-*.gguf"))
    assert [os.path.basename(p) for p in parts] == [f"tiny-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    return whole, parts


def test_the_split_model_reads_as_the_whole_file(files, tmp_path):
    whole, parts = files
    one, many = GGUFFile(whole), GGUFFile(parts[0])
    assert many.parts == parts and sorted(many.tensors) == sorted(one.tensors)
    ids = sequence(20)
    a = native_logits(make_backend(whole, str(tmp_path)), ids, 12)
    b = native_logits(make_backend(parts[0], str(tmp_path)), ids, 12)
    assert torch.equal(a, b)


def test_a_later_part_and_a_missing_part_are_refused(files, tmp_path):
    _, parts = files
    with pytest.raises(GGUFHeaderError, match=r"is not the first part of its split GGUF model: serve the file named "
                                              r"\.\.\.-00001-of-00003\.gguf"):
        GGUFFile(parts[1])
    lonely = tmp_path / os.path.basename(parts[0])
    lonely.write_bytes(open(parts[0], "rb").read())
    with pytest.raises(GGUFHeaderError, match=r"misses 2 of its 3 parts \(tiny-00002-of-00003\.gguf, "):
        GGUFFile(str(lonely))


def test_the_conversion_path_refuses_a_split_model_in_one_line(files, tmp_path):
    _, parts = files
    with pytest.raises(ConfigError, match=r"^tiny-00001-of-00003\.gguf is the first of 3 parts of a split GGUF "
                                          r"model, which llmserve reads only on its native CPU path"):
        hf_directory(parts[0], str(tmp_path))
