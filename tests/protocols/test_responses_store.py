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


# -- background responses -----------------------------------------------------------------------
STORY = dict(model="m", input="Write a long story about a dragon who learns to bake bread.", temperature=0)


def test_a_background_response_is_queued_polled_and_streamed_again(client):
    args = dict(model="m", input="Name three fruits.", temperature=0, max_output_tokens=16)
    queued = client.responses.create(**args, background=True)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    final = queued
    for _ in range(1200):
        final = client.responses.retrieve(queued.id)
        if final.status not in ("queued", "in_progress"):
            break
        __import__("time").sleep(0.1)
    assert final.status == "completed" and final.background is True
    assert final.output_text == client.responses.create(**args, store=False).output_text  # greedy: the same
    again = list(client.responses.retrieve(queued.id, stream=True, starting_after=2))
    assert [e.sequence_number for e in again] == list(range(3, 3 + len(again)))
    assert again[-1].type == "response.completed" and again[-1].response.output_text == final.output_text
    whole = list(client.responses.retrieve(queued.id, stream=True))
    assert whole[0].type == "response.created" and whole[0].response.status == "queued"
    assert "".join(e.delta for e in whole if e.type == "response.output_text.delta") == final.output_text
    # Another key neither sees it nor streams it.
    with pytest.raises(openai.NotFoundError):
        sdk_for(client, KEYS[1]).responses.retrieve(queued.id)


def test_a_background_response_streams_and_is_cancelled(client):
    stream = client.responses.create(**STORY, max_output_tokens=600, background=True, stream=True)
    response_id = None
    for event in stream:
        if event.type == "response.created":
            response_id = event.response.id
        if event.type == "response.output_text.delta":
            break  # it is generating now
    stream.close()  # leaving the stream does not stop a background response
    assert response_id is not None and client.responses.retrieve(response_id).status == "in_progress"
    cancelled = client.responses.cancel(response_id)
    assert cancelled.id == response_id and cancelled.status == "cancelled"
    assert client.responses.retrieve(response_id).status == "cancelled"
    events = list(client.responses.retrieve(response_id, stream=True))
    assert events[-1].type == "response.cancelled"
    # A response that did not run in the background cannot be cancelled.
    plain = client.responses.create(model="m", input="Hi.", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        client.responses.cancel(plain.id)


def sdk_for(client, key):
    return openai.OpenAI(base_url=str(client.base_url), api_key=key, max_retries=0, timeout=300)
