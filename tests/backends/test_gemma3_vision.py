"""Gemma 3's images on the torch backend: a tiny generated checkpoint (``tests/vision_gemma3.py``)
against transformers' own forward with the same images.

An image's tokens attend to each other both ways (the whole image, inside the sliding window), so
every attention path must read keys past a row's own position for them: the fused forward and
transformers' modules, the native prefill kernel and torch's, two sequences with other images in
one step, prefill chunks that stop before or after an image, and a chunk that continues a cached
prefix ending inside an image. A chunk that ends inside one is refused (the scheduler never makes
one: tests/engine/test_scheduler.py).
"""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")

from llmserve.engine.backend import StepItem
from llmserve.media.inputs import started_before
from llmserve.plugins.backends.torch.architectures import VISION, markdown_table
from llmserve.plugins.backends.torch.vision import runs

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
sys.path.insert(0, os.path.dirname(__file__))
import vision_gemma3
import vision_model
from test_vision_models import BS, assert_close, expand, make_backend

ONE = "<start_of_turn>user\nDescribe<start_of_image>please.<end_of_turn>\n<start_of_turn>model\n"
TWO = "<start_of_turn>user\nCompare<start_of_image>with<start_of_image>now.<end_of_turn>\n<start_of_turn>model\n"
PICTURES = [vision_model.picture(1), vision_model.picture(2, (60, 90)), vision_model.picture(3, (200, 40))]


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return vision_gemma3.write_gemma3(os.fspath(tmp_path_factory.mktemp("tiny-gemma3")))


def feed(backend, seqs: list[tuple[list[int], tuple, list[int], list[int]]]) -> list[torch.Tensor]:
    """Each sequence's logits over its positions ``bounds[0] ..``, fed in the chunks its ``bounds``
    give (``(ids, media, bounds, block table)``), every sequence in each step."""
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    for k in range(max(len(b) for _, _, b, _ in seqs) - 1):
        items = [(i, StepItem(seq_id=i + 1, token_ids=ids[b[k]:b[k + 1]], start_pos=b[k], block_table=table,
                              media=started_before(media, b[k + 1])))
                 for i, (ids, media, b, table) in enumerate(seqs) if k + 1 < len(b)]
        for (i, _), rows in zip(items, backend.forward_logits([it for _, it in items])):
            out[i].append(rows)
    return [torch.cat(rows) for rows in out]


def test_the_expansion_marks_each_image_run(path: str) -> None:
    backend = make_backend(path)
    ids, media = expand(backend, "<bos>" + TWO, PICTURES[1:])
    assert ids == vision_gemma3.expanded_ids(path, "<bos>" + TWO)
    soft = backend.info.tokenizer.convert_tokens_to_ids("<image_soft_token>")
    for m in media:
        (a, b), = m.bidirectional
        assert b - a == 16 and set(ids[a:b]) == {soft} and ids[a - 1] != soft and ids[b] != soft
        assert m.start < a and b < m.end  # the markers around the run attend causally
    assert runs([3, 4, 5, 9, 10, 12]) == ((3, 6), (9, 11), (12, 13))


@pytest.mark.parametrize("fused,kernels", [(True, True), (False, True), (True, False)],
                         ids=["fused", "transformers", "fused-torch-attention"])
def test_logits_with_images_equal_transformers(path: str, fused: bool, kernels: bool) -> None:
    """Two sequences in each step: one image (whole, and in chunks stopping before and right after
    it), two images of other shapes (chunks around them)."""
    backend = make_backend(path, fused_forward=fused, cpu_kernels=kernels)
    assert (backend._fused is not None) == fused and backend.vision.bidirectional
    ids, media = expand(backend, "<bos>" + ONE, PICTURES[:1])
    two_ids, two_media = expand(backend, "<bos>" + TWO, PICTURES[1:])
    want = vision_gemma3.reference(path, ids, PICTURES[:1])
    two_want = vision_gemma3.reference(path, two_ids, PICTURES[1:])
    (a, b), = media[0].bidirectional
    first_end = two_media[0].bidirectional[0][1]
    table, two_table = list(range(0, 8)), list(range(8, 16))
    for bounds, two_bounds in [([0, len(ids)], [0, len(two_ids)]),
                               ([0, a, len(ids)], [0, first_end, len(two_ids)]),
                               ([0, a - 1, b, len(ids)], [0, 3, first_end + 2, len(two_ids)])]:
        got, two_got = feed(backend, [(ids, media, bounds, table), (two_ids, two_media, two_bounds, two_table)])
        assert_close(got, want)
        assert_close(two_got, two_want)


@pytest.mark.parametrize("kernels", [True, False], ids=["native", "torch"])
def test_a_chunk_continuing_a_cached_prefix_inside_an_image(path: str, kernels: bool) -> None:
    """The prefix cache shares whole blocks: a later prompt with the same image may resume inside
    the image's run; its remaining rows still see the whole image."""
    backend = make_backend(path, cpu_kernels=kernels)
    ids, media = expand(backend, "<bos>" + ONE, PICTURES[:1])
    (a, b), = media[0].bidirectional
    assert a < BS < b  # the first block ends inside the run
    want = vision_gemma3.reference(path, ids, PICTURES[:1])
    feed(backend, [(ids, media, [0, len(ids)], list(range(0, 4)))])
    got, = feed(backend, [(ids, media, [BS, len(ids)], [0, *range(4, 7)])])  # block 0 is the first prompt's
    assert_close(got, want[BS:])


def test_a_chunk_ending_inside_an_image_is_refused(path: str) -> None:
    backend = make_backend(path)
    ids, media = expand(backend, "<bos>" + ONE, PICTURES[:1])
    (a, b), = media[0].bidirectional
    with pytest.raises(RuntimeError, match="both ways"):
        feed(backend, [(ids, media, [0, a + 3, len(ids)], list(range(0, 4)))])


def test_gemma3_is_in_the_architecture_table() -> None:
    assert "gemma3" in VISION
    assert "| `gemma3` | images and text" in markdown_table()
