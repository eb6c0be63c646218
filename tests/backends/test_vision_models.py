"""Vision-language models on the torch backend (``vision.py``), against transformers' own forward
with the same images: a tiny generated SmolVLM-shaped Idefics3 (``tests/vision_model.py``).

The prompt's expansion must be the processor's, token for token; the logits at every position,
on the fused forward and on transformers' modules, whole or in prefill chunks that cut through an
image, beside another sequence with other images in the same step; each image is encoded once.
"""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")

from llmserve.config import ServerConfig
from llmserve.engine.backend import KVCacheSpec, StepItem
from llmserve.errors import InvalidRequestError
from llmserve.media.inputs import block_key, check_placeholders, started_before
from llmserve.plugins.backends.torch.architectures import VISION, markdown_table
from llmserve.plugins.backends.torch.options import TorchOptions
from llmserve.plugins.backends.torch.runner import TorchBackend

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import vision_model

BS = 16
PROMPT = "<|im_start|>User:<image>What is in the picture?<end_of_utterance>\nAssistant:"
TWO = "<|im_start|>User:<image>Compare it with<image>please.<end_of_utterance>\nAssistant:"


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return vision_model.model_dir(tmp_path_factory)


def make_backend(path: str, **options: object) -> TorchBackend:
    backend = TorchBackend(ServerConfig(model=path, dtype="float32", device="cpu"), TorchOptions(**options))
    backend.info = backend.load()
    backend.init_kv_cache(KVCacheSpec(block_size=BS, num_blocks=64, state_slots=4))  # (slots: a hybrid's)
    return backend


def expand(backend: TorchBackend, text: str, images: list) -> tuple[list[int], tuple]:
    ids = backend.info.tokenizer(text, add_special_tokens=False)["input_ids"]
    return backend.info.media.expand(ids, images, "messages")


def logits(backend: TorchBackend, seqs: list[tuple[list[int], tuple]], chunks: int = 1) -> list[torch.Tensor]:
    """Every sequence's logits at every position, its prompt fed in ``chunks`` steps, all
    sequences in each step."""
    blocks = -(-max(len(ids) for ids, _ in seqs) // BS)
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    bounds = [[len(ids) * k // chunks for k in range(chunks + 1)] for ids, _ in seqs]
    for k in range(chunks):
        items = [StepItem(seq_id=i + 1, token_ids=ids[bounds[i][k]:bounds[i][k + 1]], start_pos=bounds[i][k],
                          block_table=list(range(i * blocks, (i + 1) * blocks)), state_slot=i,
                          media=started_before(media, bounds[i][k + 1]))
                 for i, (ids, media) in enumerate(seqs)]
        for i, rows in enumerate(backend.forward_logits(items)):
            out[i].append(rows)
    return [torch.cat(rows) for rows in out]


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err < 1e-4, err
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "transformers"])
def test_logits_with_images_equal_transformers(path: str, fused: bool) -> None:
    backend = make_backend(path, fused_forward=fused)
    assert (backend._fused is not None) == fused
    assert backend.info.input_modalities == ("text", "image")
    one, two, three = vision_model.picture(1), vision_model.picture(2, (60, 90)), vision_model.picture(3, (200, 40))
    want_ids, want = vision_model.reference_logits(path, PROMPT, [one])
    ids, media = expand(backend, PROMPT, [one])
    assert ids == want_ids  # the processor's expansion: tiles with row markers, then the global image
    assert len(media) == 1 and ids[media[0].start] == backend.info.tokenizer.convert_tokens_to_ids(
        "<fake_token_around_image>") and media[0].end < len(ids)
    assert_close(logits(backend, [(ids, media)])[0], want)
    # In three prefill chunks (each cutting through the image), beside a sequence with two other images.
    two_ids, two_want = vision_model.reference_logits(path, TWO, [two, three])
    other = expand(backend, TWO, [two, three])
    assert other[0] == two_ids and len(other[1]) == 2
    got, got_two = logits(backend, [(ids, media), other], chunks=3)
    assert_close(got, want)
    assert_close(got_two, two_want)
    # The image matters: the same tokens with another picture's features give other logits.
    swapped = expand(backend, PROMPT, [vision_model.picture(4)])
    assert swapped[0] != ids or not torch.allclose(logits(backend, [swapped])[0], want, atol=1e-3)


def test_each_image_is_encoded_once(path: str) -> None:
    backend = make_backend(path)
    vision = backend.vision
    image = vision_model.picture(5)
    first = expand(backend, PROMPT, [image])
    logits(backend, [first], chunks=2)
    assert (vision.encoded, vision.hits) == (1, 1)  # the second chunk found it in the cache
    # A later turn resends the image (decoded again: a new object with the same pixels).
    again = expand(backend, PROMPT + "It is noise.<end_of_utterance>\nUser:<image>And now?", [
        vision_model.picture(5), vision_model.picture(6)])
    assert again[1][0].digest == first[1][0].digest != again[1][1].digest
    # Seen before: its expansion is remembered and the processor is skipped (no pixel inputs).
    assert again[1][0].data.tensors is None and again[1][1].data.tensors is not None
    logits(backend, [again])
    assert (vision.encoded, vision.hits) == (2, 2)
    assert again[1][1].data.tensors is None  # dropped once encoded: the features are cached


def test_an_evicted_image_is_processed_and_encoded_again(path: str, monkeypatch) -> None:
    """A picture seen before whose features left the encoder cache: the engine thread runs the
    processor on the kept picture, and the logits are transformers' still."""
    from llmserve.plugins.backends.torch import vision

    backend = make_backend(path)
    picture = vision_model.picture(7)
    logits(backend, [expand(backend, PROMPT, [picture])])
    monkeypatch.setattr(vision, "ENCODER_CACHE_BYTES", 0)  # every new entry evicts the older ones
    logits(backend, [expand(backend, PROMPT, [vision_model.picture(8)])])
    ids, media = expand(backend, PROMPT, [vision_model.picture(7)])
    assert media[0].data.tensors is None and backend.vision.encoded == 2
    assert_close(logits(backend, [(ids, media)])[0], vision_model.reference_logits(path, PROMPT, [picture])[1])
    assert backend.vision.encoded == 3


def test_only_steps_feeding_an_image_run_eagerly(path: str) -> None:
    """Positions do not move after an Idefics3 image: a decode step after it may replay a CUDA
    graph; a prefill chunk holding image rows may not."""
    backend = make_backend(path)
    ids, media = expand(backend, PROMPT, [vision_model.picture(1)])
    decode = StepItem(seq_id=1, token_ids=[5], start_pos=len(ids), block_table=list(range(8)), media=media)
    chunk = StepItem(seq_id=2, token_ids=ids[:8], start_pos=media[0].start - 4, block_table=list(range(8, 16)),
                     media=media)
    assert not backend.vision.eager([decode]) and backend.vision.eager([decode, chunk])


def test_placeholders_and_images_must_agree(path: str) -> None:
    backend = make_backend(path)
    with pytest.raises(InvalidRequestError, match=r"2 image placeholders \(<image>\) for 1 images"):
        expand(backend, TWO, [vision_model.picture(1)])
    ids, media = expand(backend, PROMPT, [vision_model.picture(1)])
    image_id = backend.vision.placeholder_id
    check_placeholders(ids, media, image_id, "messages")  # every placeholder inside its image
    with pytest.raises(InvalidRequestError, match="placeholder token where no image was sent") as err:
        check_placeholders(ids, (), image_id, "messages")  # the expansion's ids sent again without the image
    assert err.value.param == "messages"


def test_block_keys_name_the_images_in_each_block(path: str) -> None:
    backend = make_backend(path)
    text = PROMPT.replace("User:", "User:Here is a picture I took this morning in the garden behind our house:")
    ids, media = expand(backend, text, [vision_model.picture(1)])
    (image,) = media
    keys = [block_key(media, i, BS) for i in range(-(-len(ids) // BS))]
    assert keys[0] == b"" and image.start >= BS  # the text before the image shares blocks
    assert all(k == image.digest.encode() for k in keys[image.start // BS:(image.end - 1) // BS + 1])


def test_vision_models_are_in_the_architecture_table() -> None:
    table = markdown_table()
    assert all(f"| `{arch}` | images and text" in table for arch in VISION)
