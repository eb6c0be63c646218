"""The official ``ollama`` client against the real embedded SmolLM2 (the session server, every
default dialect): list, show, ps, chat and generate (streamed and not), ``context``
continuation, ``format`` with a JSON schema, ``pull`` refused, bad input a 400."""

from __future__ import annotations

import json

import gguf
import jsonschema
import ollama
import pytest

from llmserve.plugins.backends.torch.loader import embedded_model_path

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct:latest"
GREEDY = {"temperature": 0, "num_predict": 12}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(smollm_server):
    return ollama.Client(host=smollm_server.url, timeout=300)


def gguf_tensor_bytes(path: str) -> int:
    """The bytes of every tensor of a GGUF file, read with the gguf package's own reader."""
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def test_list_show_ps(client):
    [model] = client.list().models
    assert model.model == MODEL and model.details.family == "llama" and model.details.format == "gguf"
    # The embedded GGUF is served in its own quantization: size is its tensors' bytes in the file.
    assert model.details.parameter_size == "134.5M" and model.size == gguf_tensor_bytes(embedded_model_path())
    shown = client.show(MODEL)
    assert shown.capabilities == ["completion"] and "<|im_start|>" in shown.template
    assert shown.modelinfo["llama.context_length"] == 2048 and shown.modelinfo["llama.block_count"] == 30
    [running] = client.ps().models
    assert running.model == MODEL and running.context_length == 2048 and running.digest == model.digest


def test_chat_streamed_and_not(client):
    reply = client.chat(model=MODEL, messages=QUESTION, options=GREEDY)
    assert "Paris" in reply.message.content and reply.message.role == "assistant"
    assert reply.done and reply.done_reason in ("stop", "length") and 0 < reply.eval_count <= 12
    assert reply.prompt_eval_count > 10 and reply.total_duration >= reply.eval_duration > 0
    chunks = list(client.chat(model=MODEL, messages=QUESTION, options=GREEDY, stream=True))
    assert all(not c.done for c in chunks[:-1]) and chunks[-1].done and chunks[-1].message.content == ""
    assert "Paris" in "".join(c.message.content for c in chunks)
    assert chunks[-1].eval_count >= len(chunks) - 1  # one piece per token at most (EOS adds none)


def test_generate_streamed_and_continued(client):
    first = client.generate(model=MODEL, prompt="Name a primary color.", options=GREEDY)
    assert first.response and first.done and first.prompt_eval_count + first.eval_count >= len(first.context)
    assert len(first.context) >= first.prompt_eval_count + first.eval_count - 1  # the final EOS is not kept
    pieces = list(client.generate(model=MODEL, prompt="Name a primary color.", options=GREEDY, stream=True))
    assert pieces[-1].done and pieces[-1].context and "".join(p.response for p in pieces).strip()
    more = client.generate(model=MODEL, prompt="And another one?", context=first.context, options=GREEDY)
    assert more.response and more.prompt_eval_count > len(first.context)
    assert more.context[: len(first.context)] == list(first.context)


def test_format_json_schema_returns_matching_json(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}},  # bounds: not enforced
              "required": ["name", "age"]}
    reply = client.chat(model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}],
                        format=schema, options={"temperature": 0, "num_predict": 60})
    assert reply.done_reason == "stop"  # the schema bounds the output: it ends well before num_predict
    jsonschema.validate(json.loads(reply.message.content), schema)


def test_pull_is_refused_clearly(client):
    with pytest.raises(ollama.ResponseError) as info:
        client.pull("llama3.2")
    assert info.value.status_code == 403
    assert "does not manage models" in info.value.error and "--model" in info.value.error


def test_bad_input_is_a_400_in_ollama_format(client):
    for kwargs, words in [({"options": {"temperature": "hot"}}, "temperature"),
                          ({"options": {"top_p": 5}}, "options.top_p"),
                          ({"format": {"type": "object", "properties": {"a": "bad"}}}, "format"),
                          ({"think": True}, "does not support thinking")]:
        with pytest.raises(ollama.ResponseError) as info:
            client.chat(model=MODEL, messages=QUESTION, **kwargs)
        assert info.value.status_code == 400 and words in info.value.error, (kwargs, info.value.error)
