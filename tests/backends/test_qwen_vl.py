"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 (dense and MoE) on the torch backend: positions along
three axes (``mrope.py``), Qwen3-VL's inner vision features added after the first layers, Qwen3.5's
images on the hybrid forward (its recurrent layers read the image rows too), and the image-only
processor (``image_tokens.py``), against transformers' own forward with the same images on tiny
generated checkpoints (``tests/vision_model.py``).

The positions of every token must be transformers' ``get_rope_index``'s, for any range of a prompt
(prefill chunks start anywhere, after some images and inside others); the logits at every position,
on the fused forward and on transformers' modules, whole or in chunks, beside another sequence with
other images in the same step.
"""

from __future__ import annotations

import os
import sys
from functools import partial

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")

from llmserve.media.inputs import MediaInput
from llmserve.plugins.backends.torch import mrope
from llmserve.plugins.backends.torch.architectures import VISION, markdown_table
from llmserve.plugins.backends.torch.vision import ImageInputs

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
sys.path.insert(0, os.path.dirname(__file__))
import vision_model
from test_vision_models import assert_close, expand, logits, make_backend

ONE = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is in the picture?<|im_end|>\n" \
      "<|im_start|>assistant\n"
TWO = "<|im_start|>user\nCompare<|vision_start|><|image_pad|><|vision_end|>with<|vision_start|><|image_pad|>" \
      "<|vision_end|>please.<|im_end|>\n<|im_start|>assistant\n"


WRITERS = {"qwen2_vl": vision_model.write_qwen2_vl, "qwen2_5_vl": vision_model.write_qwen2_5_vl,
           "qwen3_vl": vision_model.write_qwen3_vl, "qwen3_5": vision_model.write_qwen3_5,
           "qwen3_5_moe": partial(vision_model.write_qwen3_5, moe=True)}
# Each rotary dimension's axis (head_dim 16, mrope_section [2, 3, 3], per half): Qwen2-VL's and
# Qwen2.5-VL's contiguous (time, rows, columns), Qwen3-VL's interleaved.
CONTIGUOUS = [0, 0, 1, 1, 1, 2, 2, 2] * 2
AXES = {"qwen2_vl": CONTIGUOUS, "qwen2_5_vl": CONTIGUOUS, "qwen3_vl": [0, 1, 2, 0, 1, 2, 0, 1] * 2}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory, family: str) -> str:
    return WRITERS[family](os.fspath(tmp_path_factory.mktemp(f"tiny-{family}")))


@pytest.mark.parametrize("family", sorted(WRITERS), indirect=True)
def test_positions_equal_transformers_rope_index(family: str) -> None:
    """Three images of other shapes (wide, tall, square) between text: every range's positions."""
    from transformers import AutoConfig, AutoModel

    kind = AutoConfig.for_model(family)
    config = type(kind)(text_config={"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                                           "num_key_value_heads": 1, "intermediate_size": 16, "vocab_size": 64},
                              vision_config={"depth": 1, "hidden_size": 16, "num_heads": 2, "out_hidden_size": 16},
                              image_token_id=7)
    model = AutoModel.from_config(config)
    grids = [(1, 12, 20), (1, 8, 4), (1, 6, 6)]  # before the 2x2 merge
    ids, media = [1, 2, 3], []
    for g in grids:
        n = g[0] * g[1] * g[2] // 4
        media.append(MediaInput(str(g), len(ids), len(ids) + n,
                                ImageInputs(None, None, torch.empty(0), (g[0], g[1] // 2, g[2] // 2))))
        ids += [7] * n + [4, 5]
    input_ids = torch.tensor([ids])
    want, delta = model.get_rope_index(input_ids, (input_ids == 7).int(), torch.tensor(grids))
    want = want[:, 0]
    assert int(delta) < 0
    assert torch.equal(mrope.item_positions(media, 0, len(ids)), want)
    for lo, hi in [(0, 5), (5, 70), (60, 61), (61, 80), (len(ids) - 1, len(ids))]:
        assert torch.equal(mrope.item_positions(media, lo, hi), want[:, lo:hi]), (lo, hi)
    # An answer's tokens continue from the last position, shifted as the prompt's last one.
    after = mrope.item_positions(media, len(ids), len(ids) + 3)
    assert after.tolist() == [[int(want.max()) + 1 + k for k in range(3)]] * 3


def test_rotary_axes_follow_the_models_split(path: str, family: str) -> None:
    backend = make_backend(path)
    if family.startswith("qwen3_5"):  # the hybrid forward hands the three axes to the model's own rotary module
        assert type(backend._fused).__name__ == "HybridDecoder" and backend.vision.mrope
        return
    assert backend._fused.mrope_axes.tolist() == AXES[family]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "transformers"])
def test_logits_with_images_equal_transformers(path: str, fused: bool) -> None:
    backend = make_backend(path, fused_forward=fused)
    assert (backend._fused is not None) == fused
    assert backend.info.input_modalities == ("text", "image")
    one, two, three = vision_model.picture(1), vision_model.picture(2, (60, 90)), vision_model.picture(3, (200, 40))
    want_ids, want = vision_model.qwen_reference_logits(path, ONE, [one])
    ids, media = expand(backend, ONE, [one])
    assert ids == want_ids
    assert [m.data.grid for m in media][0][1:] != (1, 1)
    two_ids, two_want = vision_model.qwen_reference_logits(path, TWO, [two, three])
    other = expand(backend, TWO, [two, three])
    assert other[0] == two_ids
    for chunks in (1, 3):  # chunks of the second prompt start inside and after its images
        got, got_two = logits(backend, [(ids, media), other], chunks)
        assert_close(got, want)
        assert_close(got_two, two_want)


def test_steps_after_an_image_run_eagerly(path: str) -> None:
    """A decode step after an image has moved positions, which a CUDA graph's plain positions
    would miss (an Idefics3 decode step after its image may replay one: test_vision_models)."""
    from llmserve.engine.backend import StepItem

    backend = make_backend(path)
    ids, media = expand(backend, ONE, [vision_model.picture(1)])
    decode = StepItem(seq_id=1, token_ids=[5], start_pos=len(ids), block_table=[0, 1, 2], media=media)
    text = StepItem(seq_id=2, token_ids=[5], start_pos=len(ids), block_table=[3, 4, 5])
    assert backend.vision.eager([text, decode]) and not backend.vision.eager([text])


def test_an_image_changes_the_answer_and_is_encoded_once(path: str) -> None:
    backend = make_backend(path)
    first = logits(backend, [expand(backend, ONE, [vision_model.picture(1)])])[0]
    other = logits(backend, [expand(backend, ONE, [vision_model.picture(4)])])[0]
    assert not torch.allclose(first[-1], other[-1])
    encoded = backend.vision.encoded
    again = logits(backend, [expand(backend, ONE, [vision_model.picture(1)])])[0]
    assert backend.vision.encoded == encoded and backend.vision.hits >= 1
    assert torch.equal(again, first)


def test_qwen_vl_is_in_the_architecture_table() -> None:
    for family in WRITERS:
        assert family in VISION
        assert f"| `{family}` | images and text" in markdown_table()
