"""The real ``tritonclient.http`` against a real server process on the echo backend (fast): the
client's defaults (binary tensors, binary outputs, URL-quoted names with '/'), its error
mapping, and that errors do not break its pooled keep-alive connections."""

from __future__ import annotations

import pytest
from conftest import ECHO_PLUGIN, serving

np = pytest.importorskip("numpy")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException

MODEL = "org/model"


@pytest.fixture(scope="module")
def client():
    with serving("--backend", "echo", "--plugin", ECHO_PLUGIN, "--served-model-name", MODEL,
                 "--strict-model-name", "--log-level", "warning", clean_log=True) as server:
        yield httpclient.InferenceServerClient(url=f"127.0.0.1:{server.port}")


def text_input(*prompts: bytes, binary: bool = True):
    inp = httpclient.InferInput("text_input", [len(prompts)], "BYTES")
    inp.set_data_from_numpy(np.array(list(prompts), dtype=object), binary_data=binary)
    return inp


def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL) and client.is_model_ready(MODEL, model_version="1")
    assert not client.is_model_ready("nope") and not client.is_model_ready(MODEL, model_version="3")
    meta = client.get_model_metadata(MODEL)
    assert meta["name"] == MODEL and meta["versions"] == ["1"]
    assert client.get_model_config(MODEL)["name"] == MODEL
    assert client.get_server_metadata()["name"] == "llmserve"
    assert client.get_model_repository_index() == [{"name": MODEL, "version": "1", "state": "READY"}]


@pytest.mark.parametrize("binary_in", [True, False])
def test_text_infer_defaults(client, binary_in):
    result = client.infer(MODEL, [text_input(b"hello", "h\u00e9".encode(), binary=binary_in)],
                          parameters={"max_new_tokens": 4})
    assert list(result.as_numpy("text_output")) == [b"hell", "h\u00e9".encode()]  # binary output: bytes
    out = httpclient.InferRequestedOutput("text_output", binary_data=False)
    result = client.infer(MODEL, [text_input(b"json", binary=binary_in)], outputs=[out], request_id="r-1")
    assert list(result.as_numpy("text_output")) == ["json"]  # JSON output: str
    assert result.get_response()["id"] == "r-1"


@pytest.mark.parametrize("binary", [True, False])
def test_token_infer(client, binary):
    ids = httpclient.InferInput("input0", [1, 3], "UINT32")
    ids.set_data_from_numpy(np.array([[104, 105, 33]], dtype=np.uint32), binary_data=binary)
    result = client.infer(MODEL, [ids], priority=1, timeout=10,
                          outputs=[httpclient.InferRequestedOutput("output0", binary_data=binary)])
    out = result.as_numpy("output0")
    assert out.dtype == np.uint32 and out.tolist() == [[104, 105, 33, 256]]


def test_errors_raise_and_keep_the_client_usable(client):
    with pytest.raises(InferenceServerException) as err:
        client.infer("nope", [text_input(b"x")])
    assert err.value.status() == "404" and "unknown model" in err.value.message()
    bad = httpclient.InferInput("foo", [1], "BYTES")
    bad.set_data_from_numpy(np.array([b"x"], dtype=object))
    with pytest.raises(InferenceServerException) as err:
        client.infer(MODEL, [bad])
    assert err.value.status() == "400" and "unexpected inference input 'foo'" in err.value.message()
    with pytest.raises(InferenceServerException) as err:
        client.infer(MODEL, [text_input(b"x")], parameters={"temperature": 0})
    assert err.value.status() == "400" and "temperature" in err.value.message()
    with pytest.raises(InferenceServerException) as err:
        client.infer(MODEL, [text_input(b"x")], timeout=10**6)  # tritonclient means microseconds; we take seconds
    assert err.value.status() == "400" and "timeout" in err.value.message()
    stats = client.get_inference_statistics(MODEL)["model_stats"][0]
    assert stats["name"] == MODEL and int(stats["inference_count"]) >= 1
    # the same pooled connections still work
    assert client.infer(MODEL, [text_input(b"ok")]).as_numpy("text_output").tolist() == [b"ok"]
