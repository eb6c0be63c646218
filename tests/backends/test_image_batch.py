"""New images of several requests in one step go through the vision tower in one call
(``image_batch.py``): the joined inputs' features, split back per picture, must be what each
picture gives alone (the logits with them transformers' own), for Idefics3's tiles (pictures of
other tile counts), Gemma 3's fixed-size pictures and Qwen2.5-VL's patches; inputs that do not
join are encoded one by one.
"""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")

from llmserve.plugins.backends.torch import image_batch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
sys.path.insert(0, os.path.dirname(__file__))
import test_gemma3_vision
import test_qwen_vl
import vision_gemma3
import vision_model
from test_vision_models import PROMPT, assert_close, expand, logits, make_backend


def test_inputs_join_along_the_dimension_that_counts_pictures() -> None:
    t = torch.zeros
    assert image_batch.join([{"x": t(1, 3, 8, 8)}, {"x": t(1, 3, 8, 8)}])["x"].shape == (2, 3, 8, 8)
    assert image_batch.join([{"x": t(1, 2, 3, 8)}, {"x": t(1, 5, 3, 8)}])["x"].shape == (1, 7, 3, 8)  # tiles
    assert image_batch.join([{"p": t(12, 6), "g": t(1, 3)}, {"p": t(20, 6), "g": t(1, 3)}])["p"].shape == (32, 6)
    for apart in ([{"x": t(2, 3)}, {"x": t(2, 4)}], [{"x": t(1, 3)}, {"y": t(1, 3)}], [{"x": t(2)}, {"x": t(2, 1)}]):
        assert image_batch.join(apart) is None
    parts = [{"x": t(2, 3)}, {"x": t(2, 4)}, {"x": t(5, 3)}]
    assert image_batch.groups(parts) == [[0, 2], [1]]


def _counting(backend, monkeypatch) -> list[int]:
    """The vision tower's calls (each call's image-token count) from now on."""
    calls: list[int] = []
    tower = backend.vision._tower

    def counted(tensors):
        out = tower(tensors)
        calls.append(out.shape[1])
        return out

    monkeypatch.setattr(backend.vision, "_tower", counted)
    return calls


def test_idefics3_pictures_of_other_tile_counts_encode_in_one_call(monkeypatch, tmp_path_factory) -> None:
    path = vision_model.model_dir(tmp_path_factory)
    backend = make_backend(path)
    calls = _counting(backend, monkeypatch)
    pictures = [vision_model.picture(11), vision_model.picture(12, (200, 40))]
    seqs = [expand(backend, PROMPT, [p]) for p in pictures]
    assert seqs[0][1][0].data.tensors["pixel_values"].shape[1] != seqs[1][1][0].data.tensors["pixel_values"].shape[1]
    got = logits(backend, seqs)
    assert len(calls) == 1 and calls[0] == sum(m.data.positions.numel() for _, (m,) in seqs)
    for (ids, _), p, g in zip(seqs, pictures, got):
        want_ids, want = vision_model.reference_logits(path, PROMPT, [p])
        assert ids == want_ids
        assert_close(g, want)
    assert backend.vision.encoded == 2 and backend.vision.encoder_queries == 2 and backend.vision.encoder_hits == 0


def test_gemma3_and_qwen_pictures_encode_in_one_call(monkeypatch, tmp_path_factory) -> None:
    gemma = vision_gemma3.write_gemma3(os.fspath(tmp_path_factory.mktemp("tiny-gemma3")))
    backend = make_backend(gemma)
    calls = _counting(backend, monkeypatch)
    pictures = [vision_model.picture(13), vision_model.picture(14, (200, 40)), vision_model.picture(13)]
    seqs = [expand(backend, "<bos>" + test_gemma3_vision.ONE, [p]) for p in pictures]
    got = logits(backend, seqs)
    assert calls == [32]  # two new pictures in one call; the third is the first one again
    for (ids, _), p, g in zip(seqs, pictures, got):
        assert_close(g, vision_gemma3.reference(gemma, ids, [p]))
    vision = backend.vision
    assert (vision.encoded, vision.encoder_queries, vision.encoder_hits) == (2, 3, 1)

    qwen = test_qwen_vl.WRITERS["qwen2_5_vl"](os.fspath(tmp_path_factory.mktemp("tiny-qwen2_5_vl")))
    backend = make_backend(qwen)
    calls = _counting(backend, monkeypatch)
    pictures = [vision_model.picture(15), vision_model.picture(16, (60, 90))]
    seqs = [expand(backend, test_qwen_vl.ONE, [p]) for p in pictures]
    got = logits(backend, seqs)
    assert len(calls) == 1
    for p, g in zip(pictures, got):
        assert_close(g, vision_model.qwen_reference_logits(qwen, test_qwen_vl.ONE, [p])[1])
