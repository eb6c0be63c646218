"""GGUF vision models: a text GGUF with its ``mmproj`` projector file (``gguf_vision.py``), written
from a tiny Idefics3 checkpoint as llama.cpp's converter writes them (``tests/vision_gguf.py``).
The language model runs on the native GGUF path, the vision tower and projector from the mmproj
file; the logits with images must be transformers' forward of the folder both came from, and a
served answer its greedy ``generate``. The projector file is found beside the model or named
with ``--mmproj``; a wrong one is refused at start, naming it.
"""

from __future__ import annotations

import base64
import os
import shutil
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")
pytest.importorskip("gguf")

from llmserve.config import ServerConfig
from llmserve.engine.backend import StepItem
from llmserve.errors import ConfigError
from llmserve.media.inputs import started_before
from llmserve.plugins.backends.torch.options import TorchOptions
from llmserve.plugins.backends.torch.runner import TorchBackend

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
sys.path.insert(0, os.path.dirname(__file__))
import vision_gguf
import vision_model
from conftest import serving
from test_vision_models import PROMPT, TWO, assert_close, expand, logits, make_backend


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return vision_model.model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def gguf_path(folder: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return vision_gguf.write_idefics3_gguf(folder, os.fspath(tmp_path_factory.mktemp("gguf-vlm")))


def test_logits_with_images_equal_transformers(folder: str, gguf_path: str) -> None:
    backend = make_backend(gguf_path)
    assert backend._gguf is not None and backend._fused is not None  # the native GGUF path
    assert backend.info.input_modalities == ("text", "image")
    one, two, three = vision_model.picture(1), vision_model.picture(2, (60, 90)), vision_model.picture(3, (200, 40))
    want_ids, want = vision_model.reference_logits(folder, PROMPT, [one])
    ids, media = expand(backend, PROMPT, [one])
    assert ids == want_ids
    two_ids, two_want = vision_model.reference_logits(folder, TWO, [two, three])
    other = expand(backend, TWO, [two, three])
    assert other[0] == two_ids
    for chunks in (1, 3):  # prefill chunks cutting through the images, two sequences a step
        got, got_two = logits(backend, [(ids, media), other], chunks)
        assert_close(got, want)
        assert_close(got_two, two_want)


def test_mmproj_named_or_found_or_refused(gguf_path: str, tmp_path) -> None:
    text_only = tmp_path / "alone"
    text_only.mkdir()
    model = str(shutil.copy(gguf_path, text_only / "model.gguf"))
    projector = os.path.join(os.path.dirname(gguf_path), "mmproj-model-F32.gguf")
    assert make_backend(model).info.input_modalities == ("text",)  # no projector beside it
    named = TorchBackend(ServerConfig(model=model, mmproj=projector, dtype="float32", device="cpu"), TorchOptions())
    assert named.load().input_modalities == ("text", "image")
    shutil.copy(projector, text_only / "mmproj-a.gguf")
    shutil.copy(projector, text_only / "mmproj-b.gguf")
    assert make_backend(model).info.input_modalities == ("text",)  # two beside it: which one is unknown
    os.remove(text_only / "mmproj-b.gguf")
    shutil.copy(model, text_only / "mmproj-a.gguf")  # a broken one beside it: logged, text only
    assert make_backend(model).info.input_modalities == ("text",)
    for wrong, message in [(model, "not a vision projector file"), (str(tmp_path / "none.gguf"), "no such file")]:
        with pytest.raises(ConfigError, match=message):
            TorchBackend(ServerConfig(model=model, mmproj=wrong, dtype="float32", device="cpu"), TorchOptions()).load()
    off_path = TorchBackend(ServerConfig(model=model, mmproj=projector, dtype="float32", device="cpu"),
                            TorchOptions(gguf_native=False))
    with pytest.raises(ConfigError, match="native GGUF path"):
        off_path.load()


def test_unknown_projector_type_is_refused(gguf_path: str, tmp_path) -> None:
    import gguf

    out = str(tmp_path / "mmproj-other.gguf")
    w = gguf.GGUFWriter(out, "clip")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", "pixtral")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    backend = TorchBackend(ServerConfig(model=gguf_path, mmproj=out, dtype="float32", device="cpu"), TorchOptions())
    with pytest.raises(ConfigError, match="projector type 'pixtral' is not served"):
        backend.load()


def test_served_answer_equals_transformers_generate(folder: str, gguf_path: str) -> None:
    import openai

    n = 6
    want = vision_model.reference_generate(folder, PROMPT, [vision_model.picture(2)], n)
    url = "data:image/png;base64," + base64.b64encode(vision_model.png(2)).decode()
    with serving(gguf_path, "--dtype", "float32", "--device", "cpu", "--served-model-name", "vlm-gguf",
                 "--block-size", "16", "--log-level", "warning", timeout=300, clean_log=True) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        reply = client.chat.completions.create(
            model="vlm-gguf", max_tokens=n, temperature=0, logprobs=True,
            extra_body={"return_tokens_as_token_ids": True, "min_tokens": n},
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                   {"type": "text", "text": "What is in the picture?"}]}])
    assert [int(t.token.removeprefix("token_id:")) for t in reply.choices[0].logprobs.content] == want


def test_gemma3_gguf_with_its_projector_equals_transformers(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A Gemma 3 GGUF (``gemma3``) and its ``gemma3`` projector: the pooled image tokens attend to
    each other both ways on the native path too, in one chunk or after a chunk stopping before
    the image."""
    import vision_gemma3

    folder = vision_gemma3.write_gemma3(os.fspath(tmp_path_factory.mktemp("tiny-gemma3")))
    path = vision_gguf.write_gemma3_gguf(folder, os.fspath(tmp_path_factory.mktemp("gguf-gemma3")))
    backend = make_backend(path)
    assert backend._gguf is not None and backend.info.input_modalities == ("text", "image")
    assert backend.vision.bidirectional
    text = "<start_of_turn>user\nDescribe<start_of_image>please.<end_of_turn>\n<start_of_turn>model\n"
    ids, media = expand(backend, text, [vision_model.picture(1)])
    (a, b), = media[0].bidirectional  # (the file's tokenizer: the folder's ids, another pre-tokenizer)
    assert set(ids[a:b]) == {backend.info.tokenizer.convert_tokens_to_ids("<image_soft_token>")} and b - a == 16
    want = vision_gemma3.reference(folder, ids, [vision_model.picture(1)])
    for chunks in ([0, len(ids)], [0, a, len(ids)]):
        got = torch.cat([backend.forward_logits([StepItem(
            seq_id=1, token_ids=ids[lo:hi], start_pos=lo, block_table=[0, 1, 2, 3],
            media=started_before(media, hi))])[0] for lo, hi in zip(chunks, chunks[1:])])
        assert_close(got, want)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_qwen_vl_gguf_with_its_projector_equals_transformers(family: str, tmp_path_factory) -> None:
    """A ``qwen2vl`` / ``qwen3vl`` / ``qwen35`` text GGUF and its ``qwen2vl_merger`` /
    ``qwen2.5vl_merger`` / ``qwen3vl_merger`` projector: positions along three axes on the native
    path (the rotary split read from the file's sections, contiguous or interleaved; Qwen3.5's
    hybrid forward hands them to its rotary module), Qwen3-VL's deepstack features, two images of
    other shapes, whole and in chunks."""
    import test_qwen_vl
    import vision_gguf_qwen

    folder = test_qwen_vl.WRITERS[family](os.fspath(tmp_path_factory.mktemp(f"tiny-{family}")))
    write = vision_gguf_qwen.write_qwen3_5_gguf if family == "qwen3_5" else vision_gguf_qwen.write_qwen_vl_gguf
    path = write(folder, os.fspath(tmp_path_factory.mktemp(f"gguf-{family}")))
    backend = make_backend(path)
    assert backend._gguf is not None and backend.info.input_modalities == ("text", "image") and backend.vision.mrope
    if family != "qwen3_5":  # (the hybrid forward's rotary module reads the axes itself)
        assert backend._fused.mrope_axes.tolist() == test_qwen_vl.AXES[family]
    pictures = [vision_model.picture(2, (60, 90)), vision_model.picture(3, (200, 40))]
    ids, media = expand(backend, test_qwen_vl.TWO, pictures)
    want_ids, want = vision_model.qwen_reference_logits(folder, test_qwen_vl.TWO, pictures)
    assert ids == want_ids
    for chunks in (1, 3):
        got, = logits(backend, [(ids, media)], chunks)
        assert_close(got, want)


def test_a_qwen2vl_file_is_read_whole_or_refused() -> None:
    """The ``qwen2vl`` header's rotary sections must split a head's frequencies into three axes."""
    from types import SimpleNamespace

    from llmserve.plugins.backends.torch.gguf_config import qwen_vl_config

    fields = {f"qwen2vl.{k}": v for k, v in {
        "attention.head_count": 4, "attention.head_count_kv": 2, "embedding_length": 64, "feed_forward_length": 128,
        "block_count": 2, "attention.layer_norm_rms_epsilon": 1e-6, "context_length": 4096, "rope.freq_base": 1e6,
        "rope.dimension_sections": (2, 3, 3, 0)}.items()}
    tensors = {"token_embd.weight": SimpleNamespace(shape=(64, 100))}
    config = qwen_vl_config(SimpleNamespace(fields=fields, tensors=tensors, architecture="qwen2vl"))
    assert config.mrope_axes == [0, 0, 1, 1, 1, 2, 2, 2] and config.tie_word_embeddings and config.vocab_size == 100
    for key, value in [("qwen2vl.rope.dimension_sections", (2, 3, 2, 0)), ("qwen2vl.rope.dimension_sections", None),
                       ("qwen2vl.block_count", None)]:
        with pytest.raises(ConfigError, match="qwen2vl"):
            qwen_vl_config(SimpleNamespace(fields={**fields, key: value}, tensors=tensors, architecture="qwen2vl"))
