"""Images in every dialect that carries them, to a text-only model: each form is read into the
one internal image part and checked (base64, data URLs, caps, sources), and the request is then
refused with a 400 in the dialect's own error shape that names the image's field. Malformed
images get their own 400 first."""

from __future__ import annotations

import base64
import io

import pytest

PIL = pytest.importorskip("PIL.Image")


def png() -> str:
    out = io.BytesIO()
    PIL.new("RGB", (2, 2), (1, 2, 3)).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


B64 = png()
DATA_URL = f"data:image/png;base64,{B64}"
TEXT_ONLY = "images are not supported: the served model takes text only"


def openai_chat(image_url):
    return "/v1/chat/completions", {"model": "echo", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": image_url}]}]}


def responses(image_url, **extra):
    return "/v1/responses", {"model": "echo", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is this?"}, {"type": "input_image", "image_url": image_url, **extra}]}]}


def anthropic(source):
    return "/v1/messages", {"model": "echo", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image", "source": source}]}]}


def ollama_chat(images):
    return "/api/chat", {"model": "echo", "messages": [{"role": "user", "content": "what?", "images": images}]}


def error_text(reply) -> str:
    body = reply.json()
    error = body.get("error")
    return error if isinstance(error, str) else error["message"]


@pytest.mark.parametrize(("request_", "param"), [
    (openai_chat({"url": DATA_URL, "detail": "low"}), "messages.0.content.1.image_url"),
    (openai_chat(DATA_URL), "messages.0.content.1.image_url"),
    (openai_chat({"url": "https://images.example/cat.png"}), "messages.0.content.1.image_url"),
    (responses(DATA_URL), "input.0.content.1.image_url"),
    (anthropic({"type": "base64", "media_type": "image/png", "data": B64}), None),
    (anthropic({"type": "url", "url": "https://images.example/cat.png"}), None),
    (ollama_chat([B64]), None),
    (("/api/generate", {"model": "echo", "prompt": "what?", "images": [B64]}), None),
])
def test_an_image_to_a_text_only_model_is_a_400_naming_its_field(echo_app, request_, param):
    client, _ = echo_app()
    path, body = request_
    reply = client.post(path, json=body)
    assert reply.status_code == 400 and TEXT_ONLY in error_text(reply), reply.text
    if param is not None:  # the OpenAI shapes carry the field
        assert reply.json()["error"]["param"] == param
    if path == "/v1/messages":
        assert reply.json()["type"] == "error" and reply.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(("request_", "words"), [
    (openai_chat({"url": "data:image/png;base64,***"}), "not valid base64"),
    (openai_chat({"url": DATA_URL, "detail": "ultra"}), "detail: must be auto, low or high"),
    (openai_chat({"url": "ftp://images.example/cat.png"}), "must be a data: URL, or an http(s) or file URL"),
    (openai_chat({"url": "data:image/png," + B64}), "must be base64"),
    (responses(None, file_id="file-1"), "keeps no files"),
    (responses(DATA_URL, detail="ultra"), "input.0.content.1.detail: must be auto, low or high"),
    (anthropic({"type": "base64", "media_type": "image/tiff", "data": B64}), "media_type: must be one of"),
    (anthropic({"type": "file", "file_id": "f"}), "source of type base64 or url"),
    (ollama_chat(["%%%"]), "not valid base64"),
    (ollama_chat("not-a-list"), "images"),
])
def test_a_malformed_image_is_a_400_of_its_own(echo_app, request_, words):
    client, _ = echo_app()
    path, body = request_
    reply = client.post(path, json=body)
    assert reply.status_code == 400 and words in error_text(reply), reply.text


def test_an_image_over_the_byte_cap_is_refused_before_it_is_decoded(echo_app):
    client, _ = echo_app(max_image_bytes=16)
    for path, body in (openai_chat(DATA_URL), ollama_chat([B64]),
                       anthropic({"type": "base64", "media_type": "image/png", "data": B64})):
        reply = client.post(path, json=body)
        assert reply.status_code == 400 and "larger than --max-image-bytes (16 bytes)" in error_text(reply)


def test_an_image_in_an_assistant_message_is_refused_where_it_is(echo_app):
    client, _ = echo_app()
    body = {"model": "echo", "max_tokens": 8, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "image", "source": {"type": "url", "url": "https://x.example/a"}}]},
        {"role": "user", "content": "and?"}]}
    reply = client.post("/v1/messages", json=body)
    assert reply.status_code == 400
    assert "messages.1.content.0: image blocks belong in user messages" in error_text(reply)
