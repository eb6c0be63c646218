"""Hugging Face clients' chat paths against the real embedded SmolLM2: they send placeholder model
names (``huggingface_hub.InferenceClient`` sends ``dummy``, ``text_generation.Client.chat`` and
litellm's ``huggingface/`` provider send ``tgi``), which a server with one model accepts and answers
under its served name; with ``--strict-model-name`` (here on the echo backend: the 404 comes before
any generation) each client gets a 404.

``text_generation.Client.chat(stream=True)`` is not tried: under pydantic 2 its chunk model needs
``delta.tool_calls`` in every chunk, which neither TGI nor vLLM sends."""

from __future__ import annotations

import os

import pytest
from conftest import ECHO_PLUGIN, ServerProcess

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def url(smollm_server):
    return smollm_server.url


@pytest.fixture(scope="module")
def served(url):
    import httpx

    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def strict_url():
    server = ServerProcess("--backend", "echo", "--plugin", ECHO_PLUGIN, "--strict-model-name",
                           "--log-level", "warning")
    try:
        yield server.wait_ready().url
    finally:
        server.stop()


@pytest.fixture
def hub_online(monkeypatch):
    """huggingface_hub refuses every request, even to this server, while HF_HUB_OFFLINE (set for
    the tests, so no model is downloaded) is on; its clients here only talk to the local server."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def test_huggingface_hub_chat_completion(hub_online, url, served):
    from huggingface_hub import InferenceClient

    client = InferenceClient(base_url=url, timeout=120)
    out = client.chat_completion(QUESTION, max_tokens=8, temperature=0)
    assert out.model == served and "Paris" in out.choices[0].message.content
    chunks = list(client.chat_completion(QUESTION, max_tokens=8, temperature=0, stream=True))
    assert {c.model for c in chunks} == {served}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == out.choices[0].message.content


def test_huggingface_hub_strict_is_404(hub_online, strict_url):
    from huggingface_hub import InferenceClient
    from huggingface_hub.errors import HfHubHTTPError

    client = InferenceClient(base_url=strict_url, timeout=30)
    for stream in (False, True):
        with pytest.raises(HfHubHTTPError) as info:
            list(client.chat_completion(QUESTION, max_tokens=8, stream=True)) if stream else \
                client.chat_completion(QUESTION, max_tokens=8)
        assert info.value.response.status_code == 404 and "`dummy` does not exist" in str(info.value)


def test_text_generation_chat(url, served):
    from text_generation import Client

    client = Client(url, timeout=120)
    out = client.chat(QUESTION, max_tokens=8, temperature=0)
    assert out.model == served and "Paris" in out.choices[0].message.content


def test_text_generation_strict_is_404(strict_url):
    from text_generation import Client
    from text_generation.errors import NotFoundError

    with pytest.raises(NotFoundError, match="`tgi` does not exist"):
        Client(strict_url, timeout=30).chat(QUESTION, max_tokens=8)


def test_openai_client_strict_is_404(strict_url):
    import openai

    client = openai.OpenAI(base_url=strict_url + "/v1", api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.status_code == 404 and info.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="tgi", messages=QUESTION, max_tokens=8)
    assert info.value.status_code == 404 and info.value.body["param"] == "model"


@pytest.fixture(scope="module")
def litellm():
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list at import
    import litellm

    return litellm


def test_litellm_huggingface_provider(litellm, url, served, strict_url):
    args = dict(model="huggingface/tgi", messages=QUESTION, max_tokens=8, temperature=0, api_key="unused")
    out = litellm.completion(api_base=url, **args)
    assert "Paris" in out.choices[0].message.content
    chunks = list(litellm.completion(api_base=url, stream=True, **args))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content
    import openai

    with pytest.raises(openai.APIError, match="`tgi` does not exist") as info:  # litellm's APIError for HF
        litellm.completion(api_base=strict_url, num_retries=0, **args)
    assert info.value.status_code == 404
