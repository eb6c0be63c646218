"""Qwen2.5-VL, Qwen3-VL and Qwen3.5, dense and MoE (a hybrid: its recurrent states resume from saved ones on a
prefix-cache hit) served (tiny generated checkpoints, ``tests/vision_model.py``): their
answers follow images through positions along three axes, so every answer token sits at a position moved by the
images before it. Each answer must be transformers' greedy ``generate`` on the same prompt and
images, through the openai, anthropic and ollama clients; a second turn resends the first turn's
image beside a new one.
"""

from __future__ import annotations

import base64
import os
import sys
from functools import partial

import anthropic
import ollama
import openai
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import vision_model
from conftest import serving

N = 6
QUESTION = "What is in the picture?"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def turn(role: str, text: str) -> str:
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


WRITERS = {"qwen2_5_vl": vision_model.write_qwen2_5_vl, "qwen3_vl": vision_model.write_qwen3_vl,
           "qwen3_5": vision_model.write_qwen3_5, "qwen3_5_moe": partial(vision_model.write_qwen3_5, moe=True)}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def path(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> str:
    return WRITERS[request.param](os.fspath(tmp_path_factory.mktemp(f"tiny-{request.param}")))


@pytest.fixture(scope="module")
def server(path: str):
    with serving(path, "--dtype", "float32", "--device", "cpu", "--served-model-name", "tiny-qwen-vl",
                 "--block-size", "16", "--log-level", "warning", timeout=300, clean_log=True) as proc:
        yield proc


def data_url(seed: int, size: tuple[int, int] = (150, 100)) -> str:
    return "data:image/png;base64," + base64.b64encode(vision_model.png(seed, size)).decode()


def ids_of(choice) -> list[int]:
    return [int(t.token.removeprefix("token_id:")) for t in choice.logprobs.content]


def decode(path: str, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path).decode(ids, skip_special_tokens=True)


def test_openai_chat_two_turns_with_images(server, path) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    options = {"model": "tiny-qwen-vl", "max_tokens": N, "temperature": 0, "logprobs": True,
               "extra_body": {"return_tokens_as_token_ids": True, "min_tokens": N}}
    first = [{"type": "image_url", "image_url": {"url": data_url(1)}}, {"type": "text", "text": QUESTION}]
    reply = client.chat.completions.create(messages=[{"role": "user", "content": first}], **options)
    prompt = turn("user", IMAGE + QUESTION) + "<|im_start|>assistant\n"
    want = vision_model.qwen_reference_generate(path, prompt, [vision_model.picture(1)], N)
    assert ids_of(reply.choices[0]) == want
    answer = reply.choices[0].message.content
    second = [{"type": "text", "text": "And this one,"},
              {"type": "image_url", "image_url": {"url": data_url(2, (60, 90))}}]
    reply = client.chat.completions.create(messages=[
        {"role": "user", "content": first}, {"role": "assistant", "content": answer},
        {"role": "user", "content": second}], **options)
    prompt = (turn("user", IMAGE + QUESTION) + turn("assistant", answer) + turn("user", "And this one," + IMAGE)
              + "<|im_start|>assistant\n")
    pictures = [vision_model.picture(1), vision_model.picture(2, (60, 90))]
    want = vision_model.qwen_reference_generate(path, prompt, pictures, N)
    assert ids_of(reply.choices[0]) == want
    assert reply.usage.prompt_tokens_details.cached_tokens >= 16  # the first turn's blocks, image included


def test_anthropic_and_ollama_images(server, path) -> None:
    prompt = turn("user", IMAGE + QUESTION) + "<|im_start|>assistant\n"
    want = decode(path, vision_model.qwen_reference_generate(path, prompt, [vision_model.picture(3)], N))
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
    reply = client.messages.create(
        model="tiny-qwen-vl", max_tokens=N, extra_body={"temperature": 0, "min_tokens": N},
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(vision_model.png(3)).decode()}},
            {"type": "text", "text": QUESTION}]}])
    assert "".join(b.text for b in reply.content if b.type == "text") == want
    ollama_client = ollama.Client(host=server.url, timeout=300)
    options = {"temperature": 0, "num_predict": N, "repeat_penalty": 1.0}
    reply = ollama_client.chat(model="tiny-qwen-vl", options=options,
                               messages=[{"role": "user", "content": QUESTION, "images": [vision_model.png(3)]}])
    assert reply.message.content == want
    assert "vision" in ollama_client.show("tiny-qwen-vl").capabilities
