"""The opt-in response store, through the ``openai`` SDK on the real SmolLM2: a server started
with ``responses: {store: true, store_max_responses: 3}`` in its YAML config and two API keys.

``previous_response_id`` must continue exactly as sending the whole item history would (greedy
output is deterministic, so the two replies are compared); GET and DELETE work; each key sees
only its own responses; the store never holds more than its bound.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from conftest import ServerProcess

pytestmark = pytest.mark.slow

KEYS = ("key-one", "key-two")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = tmp_path_factory.mktemp("responses") / "store.yaml"
    config.write_text("responses:\n  store: true\n  store_max_responses: 3\n")
    proc = ServerProcess("--dtype", "float32", "--device", "cpu", "--max-model-len", "2048", "--log-level",
                         "warning", "--config", str(config), "--api-key", KEYS[0], "--api-key", KEYS[1])
    try:
        yield proc.wait_ready(timeout=600)
    finally:
        proc.stop()


def sdk(server, key):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def client(server):
    return sdk(server, KEYS[0])


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model="m", instructions="Be brief.", input="My name is Alice. Say hi.",
                                    temperature=0, max_output_tokens=16)
    assert first.store is True
    follow = client.responses.create(model="m", instructions="Be brief.", input="What is my name?",
                                     previous_response_id=first.id, temperature=0, max_output_tokens=16)
    assert follow.previous_response_id == first.id
    # The same conversation sent whole, statelessly: the same prompt, hence the same greedy answer.
    history = [{"role": "user", "content": "My name is Alice. Say hi."},
               *[item.model_dump(exclude_none=True) for item in first.output],
               {"role": "user", "content": "What is my name?"}]
    whole = client.responses.create(model="m", instructions="Be brief.", input=history, temperature=0,
                                    max_output_tokens=16, store=False)
    assert whole.store is False
    assert follow.output_text == whole.output_text
    assert follow.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens
    # A chain of three: the second's history travels on after it.
    third = client.responses.create(model="m", input="And again?", previous_response_id=follow.id,
                                    temperature=0, max_output_tokens=4)
    assert third.usage.input_tokens > follow.usage.input_tokens


def test_retrieve_and_delete(client):
    r = client.responses.create(model="m", input="Say yes.", temperature=0, max_output_tokens=4, metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"k": "v"}
    assert got.usage.output_tokens == r.usage.output_tokens
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="m", input="more", previous_response_id=r.id)
    assert err.value.body["param"] == "previous_response_id"


def test_store_false_keeps_nothing(client):
    r = client.responses.create(model="m", input="Say no.", max_output_tokens=2, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_streamed_responses_are_stored_too(client):
    with client.responses.stream(model="m", input="Say hello.", temperature=0, max_output_tokens=8) as stream:
        events = list(stream)
    assert events[-1].type in ("response.completed", "response.incomplete")  # 8 tokens may cut it
    final = events[-1].response
    assert final.store is True
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_each_key_sees_only_its_own_responses(server, client):
    mine = client.responses.create(model="m", input="Private note.", max_output_tokens=2)
    other = sdk(server, KEYS[1])
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model="m", input="x", previous_response_id=mine.id)
    assert client.responses.retrieve(mine.id).id == mine.id  # still there for its owner


def test_store_stays_within_its_bound(client):
    ids = [client.responses.create(model="m", input=f"Number {i}.", max_output_tokens=2).id for i in range(5)]
    kept = []
    for rid in ids:
        try:
            kept.append(client.responses.retrieve(rid).id)
        except openai.NotFoundError:
            pass
    assert kept == ids[-3:]  # the oldest went first


def test_every_route_needs_a_key(server):
    for method, path in (("POST", "/v1/responses"), ("GET", "/v1/responses/resp_x"),
                         ("DELETE", "/v1/responses/resp_x")):
        r = httpx.request(method, server.url + path, json={"input": "hi"} if method == "POST" else None,
                          timeout=30)
        assert r.status_code == 401, (method, path, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        sdk(server, "wrong").responses.create(model="m", input="hi")
