"""Ollama's ``/api/pull`` on a server started with ``--allow-pull`` (and an API key), through the
real ``ollama`` client against a fake Hub on loopback: the pull streams status lines, the model is
then listed and served, loaded on its first request; a path or a malformed id is a 400, a repo the
Hub does not have a 404, a request without the key a 401; without ``--allow-pull`` it stays 403,
and ``--allow-pull`` without ``--api-key`` does not start."""

from __future__ import annotations

import httpx
import pytest

from repos import Server, cli, safetensors_repo

ollama = pytest.importorskip("ollama")

pytestmark = pytest.mark.slow
KEY = "sk-pull"


def ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_pull_streams_then_serves_the_model(hub_env, fake_hub):
    fake_hub.add("org/tiny", safetensors_repo())
    fake_hub.chunk_delay = 0.3  # a few seconds of download: status lines come meanwhile
    server = Server("--allow-pull", "--api-key", KEY, "--dtype", "float32", "--max-model-len", "512",
                    "--num-kv-blocks", "128", env=hub_env)
    try:
        server.wait(lambda: ready(server.url))
        client = ollama.Client(host=server.url, headers={"Authorization": f"Bearer {KEY}"})
        assert [m.model for m in client.list().models] == ["SmolLM2-135M-Instruct:latest"]
        statuses = [part.status for part in client.pull("hf.co/org/tiny", stream=True)]
        assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
        assert any(s.startswith("fetching org/tiny") for s in statuses[1:-1]), statuses
        assert [m.model for m in client.list().models] == ["SmolLM2-135M-Instruct:latest", "org/tiny:latest"]
        assert "org/tiny:latest" not in [m.model for m in client.ps().models]  # loaded on its first request
        reply = client.generate(model="org/tiny", prompt="t5 t6", options={"num_predict": 3, "temperature": 0})
        assert reply.model == "org/tiny" and reply.eval_count == 3
        assert "org/tiny:latest" in [m.model for m in client.ps().models]
        # Pulling it again is at once a success (nothing fetched again).
        gets = len(fake_hub.gets())
        assert client.pull("org/tiny", stream=False).status == "success"
        assert len(fake_hub.gets()) == gets
        for bad, status, said in (("../../etc/passwd", 400, "is not a Hugging Face repo id"),
                                  ("/etc/passwd", 400, "is not a Hugging Face repo id"),
                                  ("org/missing", 404, "cannot pull org/missing")):
            with pytest.raises(ollama.ResponseError) as err:
                client.pull(bad, stream=False)
            assert err.value.status_code == status and said in err.value.error, (bad, err.value)
        keyed = {"Authorization": f"Bearer {KEY}"}
        empty = httpx.post(server.url + "/api/pull", json={"model": ""}, headers=keyed, timeout=30)
        assert empty.status_code == 400 and empty.json() == {"error": "model is required"}
        anonymous = httpx.post(server.url + "/api/pull", json={"model": "org/tiny"}, timeout=30)
        assert anonymous.status_code == 401
    finally:
        server.stop()


def test_allow_pull_without_an_api_key_does_not_start(hub_env, fake_hub):
    out = cli("serve", "--allow-pull", "--port", "0", env=hub_env)
    assert out.returncode == 2 and out.stderr.strip() == (
        "error: --allow-pull needs --api-key: a pull downloads into this machine's cache, which only a client "
        "holding a key may ask for")
