"""Gemma 3 with images served (a tiny generated checkpoint, ``tests/vision_gemma3.py``): its image
tokens attend to each other both ways, so the server must feed each image in one step. Its step
budget (16 tokens) is smaller than a prompt, so prefill chunks must stop before an image, and a
second turn resumes from cached blocks that end inside the first turn's image. Each answer must be
transformers' greedy ``generate`` on the same prompt and images, through the openai and ollama
clients.
"""

from __future__ import annotations

import base64
import os
import sys

import ollama
import openai
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import vision_gemma3
import vision_model
from conftest import serving

N = 6
QUESTION = "What is in the picture?"


def turn(role: str, text: str) -> str:
    return f"<start_of_turn>{role}\n{text}<end_of_turn>\n"


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return vision_gemma3.write_gemma3(os.fspath(tmp_path_factory.mktemp("tiny-gemma3")))


@pytest.fixture(scope="module")
def server(path: str):
    with serving(path, "--dtype", "float32", "--device", "cpu", "--served-model-name", "tiny-gemma3",
                 "--block-size", "16", "--max-num-batched-tokens", "16", "--log-level", "warning", timeout=300,
                 clean_log=True) as proc:
        yield proc


def want(path: str, text: str, pictures: list, n: int = N) -> list[int]:
    """transformers' greedy answer to the prompt ``text`` (``<start_of_image>`` where each picture goes)."""
    from transformers import AutoTokenizer

    bos = AutoTokenizer.from_pretrained(path).bos_token
    return vision_gemma3.reference(path, vision_gemma3.expanded_ids(path, bos + text), pictures, generate=n)


def test_openai_chat_two_turns_with_images(server, path) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    options = {"model": "tiny-gemma3", "max_tokens": N, "temperature": 0, "logprobs": True,
               "extra_body": {"return_tokens_as_token_ids": True, "min_tokens": N}}
    first = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                        + base64.b64encode(vision_model.png(1)).decode()}},
             {"type": "text", "text": QUESTION}]
    reply = client.chat.completions.create(messages=[{"role": "user", "content": first}], **options)
    ids = [int(t.token.removeprefix("token_id:")) for t in reply.choices[0].logprobs.content]
    prompt = turn("user", "<start_of_image>" + QUESTION) + "<start_of_turn>model\n"
    assert ids == want(path, prompt, [vision_model.picture(1)])
    answer = reply.choices[0].message.content
    second = [{"type": "text", "text": "And this one,"},
              {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                         + base64.b64encode(vision_model.png(2, (60, 90))).decode()}}]
    reply = client.chat.completions.create(messages=[
        {"role": "user", "content": first}, {"role": "assistant", "content": answer},
        {"role": "user", "content": second}], **options)
    ids = [int(t.token.removeprefix("token_id:")) for t in reply.choices[0].logprobs.content]
    prompt = (turn("user", "<start_of_image>" + QUESTION) + turn("model", answer.strip())
              + turn("user", "And this one,<start_of_image>") + "<start_of_turn>model\n")
    assert ids == want(path, prompt, [vision_model.picture(1), vision_model.picture(2, (60, 90))])
    # The first block (16 tokens) ends inside the first image's run of 16 tokens after 6 others.
    assert reply.usage.prompt_tokens_details.cached_tokens >= 16


def test_ollama_images(server, path) -> None:
    from transformers import AutoTokenizer

    prompt = turn("user", "<start_of_image>" + QUESTION) + "<start_of_turn>model\n"
    text = AutoTokenizer.from_pretrained(path).decode(want(path, prompt, [vision_model.picture(3)]),
                                                      skip_special_tokens=True)
    client = ollama.Client(host=server.url, timeout=300)
    reply = client.chat(model="tiny-gemma3", options={"temperature": 0, "num_predict": N, "repeat_penalty": 1.0},
                        messages=[{"role": "user", "content": QUESTION, "images": [vision_model.png(3)]}])
    assert reply.message.content == text
    assert "vision" in client.show("tiny-gemma3").capabilities
