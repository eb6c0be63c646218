"""Fixtures of the guided-decoding end-to-end tests: an openai client of the session's SmolLM2
server, and the name it serves."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def client(smollm_server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=smollm_server.url + "/v1", api_key="unused", max_retries=0, timeout=240)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id
