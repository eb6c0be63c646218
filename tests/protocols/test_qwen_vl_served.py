"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5, dense and MoE (a hybrid: its recurrent states resume
from saved ones on a prefix-cache hit) served (tiny generated checkpoints,
``tests/vision_model.py``): their answers follow images through positions along three axes, so every
answer token sits at a position moved by the images before it. Each answer must be transformers'
greedy ``generate`` on the same prompt and images, through the openai, anthropic and ollama clients;
a second turn resends the first turn's image beside a new one, and the encoder cache's counters on
``/metrics`` count what it held.
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


WRITERS = {"qwen2_vl": vision_model.write_qwen2_vl, "qwen2_5_vl": vision_model.write_qwen2_5_vl,
           "qwen3_vl": vision_model.write_qwen3_vl, "qwen3_5": vision_model.write_qwen3_5,
           "qwen3_5_moe": partial(vision_model.write_qwen3_5, moe=True)}


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


def encoder_cache(url: str) -> tuple[float, float]:
    """(queries, hits) of the encoder cache, from ``/metrics``."""
    import httpx

    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
              for line in httpx.get(url + "/metrics").text.splitlines() if line.startswith("vllm:mm_cache_")}
    return values.get("vllm:mm_cache_queries_total", 0.0), values.get("vllm:mm_cache_hits_total", 0.0)


def first_image_end(path: str, prompt: str, pictures: list) -> int:
    """The position after the first image's tokens in ``prompt`` with ``pictures``."""
    from transformers import AutoTokenizer

    pad = AutoTokenizer.from_pretrained(path).convert_tokens_to_ids("<|image_pad|>")
    ids, _ = vision_model.qwen_reference_logits(path, prompt, pictures)
    start = ids.index(pad)
    end = start
    while ids[end] == pad:
        end += 1
    return end


def test_openai_chat_two_turns_with_images(server, path) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    queries, hits = encoder_cache(server.url)
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
    # The first turn's image, the new one, and the first one again unless the cached prefix (its KV; a hybrid's
    # saved state) reached past it: then it was never fed.
    cached = reply.usage.prompt_tokens_details.cached_tokens
    refed = int(cached < first_image_end(path, prompt, pictures))
    assert encoder_cache(server.url) == (queries + 2 + refed, hits + refed)
    # The first picture after other words: no prefix to reuse, but the encoder cache holds its features.
    other = [{"type": "text", "text": "Look:"}, *first]
    reply = client.chat.completions.create(messages=[{"role": "user", "content": other}], **options)
    prompt = turn("user", "Look:" + IMAGE + QUESTION) + "<|im_start|>assistant\n"
    assert ids_of(reply.choices[0]) == vision_model.qwen_reference_generate(path, prompt, [vision_model.picture(1)], N)
    assert encoder_cache(server.url) == (queries + 3 + refed, hits + 1 + refed)


def test_mindie_multimodal_inputs(server, path) -> None:
    """MindIE's ``/infer`` with a list of text and image items: one user message of the chat
    template, the image in place; a server path outside ``--allowed-local-media-path`` is a 422."""
    import httpx

    prompt = turn("user", IMAGE + QUESTION) + "<|im_start|>assistant\n"
    want = decode(path, vision_model.qwen_reference_generate(path, prompt, [vision_model.picture(4)], N))
    inputs = [{"type": "image_url", "image_url": base64.b64encode(vision_model.png(4)).decode()},
              {"type": "text", "text": QUESTION}]
    reply = httpx.post(server.url + "/infer", timeout=300, json={
        "inputs": inputs, "parameters": {"max_new_tokens": N, "do_sample": False, "details": True}})
    assert reply.status_code == 200, reply.text
    assert reply.json()["generated_text"] == want
    refused = httpx.post(server.url + "/infer", timeout=300, json={
        "inputs": [{"type": "image_url", "image_url": "/etc/hostname"}, {"type": "text", "text": QUESTION}]})
    assert refused.status_code == 422 and refused.json()["error_type"] == "Input Validation Error"
    assert "--allowed-local-media-path" in refused.json()["error"]


def test_vllm_native_multi_modal_data(server, path) -> None:
    """vLLM's ``/generate``: the prompt as the model reads it, with one placeholder per image of
    ``multi_modal_data`` (a data: URL and bare base64, in order); the reply is prompt + answer."""
    import httpx

    prompt = turn("user", IMAGE + "and" + IMAGE + QUESTION) + "<|im_start|>assistant\n"
    pictures = [vision_model.picture(5), vision_model.picture(6, (90, 60))]
    want = decode(path, vision_model.qwen_reference_generate(path, prompt, pictures, N))
    images = [data_url(5), base64.b64encode(vision_model.png(6, (90, 60))).decode()]
    reply = httpx.post(server.url + "/generate", timeout=300, json={
        "prompt": prompt, "multi_modal_data": {"image": images}, "max_tokens": N, "min_tokens": N,
        "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["text"] == [prompt + want]
    fewer = httpx.post(server.url + "/generate", timeout=300, json={
        "prompt": prompt, "multi_modal_data": {"image": images[:1]}, "max_tokens": 2})
    assert fewer.status_code == 400 and fewer.json()["error"]["param"] == "multi_modal_data.image"
    assert "2 image placeholders" in fewer.json()["error"]["message"]


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
