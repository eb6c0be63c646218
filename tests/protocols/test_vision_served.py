"""A vision-language model served, driven by the clients people attach images with: the openai
SDK (chat ``image_url`` parts and Responses ``input_image``), the anthropic SDK (``image``
blocks), the ollama client (``images``) and TGI's client (Markdown images in ``inputs``). A
tiny generated SmolVLM-shaped model (``tests/vision_model.py``): each answer's tokens must be
transformers' greedy ``generate`` on the same prompt and image; two prompts that differ only in
the image get their own answers with the prefix cache on, and a turn resending an image reuses
the cached prefix up to and past it.
"""

from __future__ import annotations

import base64
import os
import sys

import anthropic
import ollama
import openai
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import vision_model
from conftest import serving

N = 6
QUESTION = "What is in the picture?"
PROMPT = f"<|im_start|>User:<image>{QUESTION}<end_of_utterance>\nAssistant:"


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return vision_model.model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def server(path: str):
    with serving(path, "--dtype", "float32", "--device", "cpu", "--served-model-name", "tiny-vlm", "--block-size",
                 "16", "--log-level", "warning", timeout=300, clean_log=True) as proc:
        yield proc


@pytest.fixture(scope="module")
def want(path: str) -> dict[int, list[int]]:
    """transformers' greedy answer to ``PROMPT`` with picture 1 and with picture 2."""
    return {seed: vision_model.reference_generate(path, PROMPT, [vision_model.picture(seed)], N) for seed in (1, 2)}


def data_url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(vision_model.png(seed)).decode()


def ids_of(choice) -> list[int]:
    """The answer's token ids (``return_tokens_as_token_ids``: each logprob token is ``token_id:N``)."""
    return [int(t.token.removeprefix("token_id:")) for t in choice.logprobs.content]


def test_openai_chat_answers_each_image_as_transformers_does(server, want) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    answers = {}
    for seed in (1, 2, 1):  # the second prompt differs from the first only in its image
        reply = client.chat.completions.create(
            model="tiny-vlm", max_tokens=N, temperature=0, logprobs=True,
            extra_body={"return_tokens_as_token_ids": True, "min_tokens": N},
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(seed)}},
                                                   {"type": "text", "text": QUESTION}]}])
        assert ids_of(reply.choices[0]) == want[seed], seed
        answers.setdefault(seed, []).append(reply.usage)
    assert want[1] != want[2]
    # The repeated request found every full block of its prompt in the prefix cache, the image's
    # blocks included; the one with picture 2 found none (its first block holds the image's start).
    first, again = answers[1]
    assert again.prompt_tokens == first.prompt_tokens > 32
    assert again.prompt_tokens_details.cached_tokens == (again.prompt_tokens - 1) // 16 * 16
    assert answers[2][0].prompt_tokens_details.cached_tokens == 0


def test_openai_responses_input_image(server, want, path) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    reply = client.responses.create(
        model="tiny-vlm", max_output_tokens=N, temperature=0, store=False,
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": data_url(2)},
                                            {"type": "input_text", "text": QUESTION}]}])
    assert reply.output_text == decode(path, want[2])


def test_anthropic_image_block(server, want, path) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
    reply = client.messages.create(
        model="tiny-vlm", max_tokens=N, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(vision_model.png(1)).decode()}},
            {"type": "text", "text": QUESTION}]}])
    assert "".join(b.text for b in reply.content if b.type == "text") == decode(path, want[1])


def test_ollama_chat_and_generate_images(server, want, path) -> None:
    client = ollama.Client(host=server.url, timeout=300)
    options = {"temperature": 0, "num_predict": N, "repeat_penalty": 1.0}  # Ollama penalises repeats by default
    reply = client.chat(model="tiny-vlm", options=options,
                        messages=[{"role": "user", "content": QUESTION, "images": [vision_model.png(2)]}])
    assert reply.message.content == decode(path, want[2])
    generated = client.generate(model="tiny-vlm", prompt=QUESTION, images=[vision_model.png(1)], options=options)
    assert generated.response == decode(path, want[1])
    assert "vision" in client.show("tiny-vlm").capabilities


def test_tgi_markdown_images_in_inputs(server, path) -> None:
    """TGI's form: a Markdown image inside the raw prompt, at the place of the model's placeholder."""
    from text_generation import Client
    from text_generation.errors import ValidationError

    client = Client(server.url, timeout=300)
    image = f"![a picture]({data_url(2)})"
    reply = client.generate(f"{image}{QUESTION}", max_new_tokens=N, decoder_input_details=True)
    want = vision_model.reference_generate(path, f"<image>{QUESTION}", [vision_model.picture(2)], N)
    assert [t.id for t in reply.details.tokens] == want
    assert reply.details.prefill[0].text and len(reply.details.prefill) > 20  # the image's tokens count
    with pytest.raises(ValidationError, match="truncate. would cut into an image"):
        client.generate(f"{image}{QUESTION}", max_new_tokens=2, truncate=8)
    with pytest.raises(ValidationError, match="not valid base64"):
        client.generate(f"![](data:image/png;base64,%%%){QUESTION}", max_new_tokens=2)


def test_models_list_says_it_reads_images(server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    [model] = client.models.list().data
    assert model.model_extra["architecture"]["input_modalities"] == ["text", "image"]


def test_a_placeholder_without_its_image_is_a_400(server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="image placeholder token where no image was sent"):
        client.completions.create(model="tiny-vlm", prompt="Look: <image> there.", max_tokens=2)


def decode(path: str, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path).decode(ids, skip_special_tokens=True)
