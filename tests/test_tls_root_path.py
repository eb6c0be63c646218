"""HTTPS (``--ssl-certfile`` / ``--ssl-keyfile``) and serving behind a path-prefix proxy (``--root-path``)."""

from __future__ import annotations

import ssl
import subprocess
import time

import httpx
import openai
import pytest

from conftest import ECHO_PLUGIN, ServerProcess, run_cli

ECHO = ("--backend", "echo", "--plugin", ECHO_PLUGIN)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and its key (PEM files)."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = str(folder / "cert.pem"), str(folder / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


def wait_https(server: ServerProcess, cert: str, timeout: float = 60) -> str:
    url = f"https://127.0.0.1:{server.port}"
    trusted = ssl.create_default_context(cafile=cert)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.stop()}")
        try:
            # /ready, not /health: /health answers while the model still loads
            if httpx.get(url + "/ready", verify=trusted, timeout=1).status_code == 200:
                return url
        except httpx.HTTPError:
            time.sleep(0.2)
    raise TimeoutError(server.stop())


def test_serves_https_with_the_given_certificate(certificate):
    cert, key = certificate
    server = ServerProcess(*ECHO, "--ssl-certfile", cert, "--ssl-keyfile", key)
    try:
        url = wait_https(server, cert)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                               http_client=httpx.Client(verify=ssl.create_default_context(cafile=cert)))
        reply = client.completions.create(model="echo", prompt="secure", max_tokens=6)
        assert reply.choices[0].text == "secure"
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served on that port
            httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=2)
    finally:
        server.stop()


@pytest.mark.parametrize("args, words", [
    (("--ssl-keyfile", "key.pem"), "--ssl-keyfile needs --ssl-certfile"),
    (("--ssl-certfile", "missing.pem", "--ssl-keyfile", "missing.pem"), "cannot serve HTTPS"),
    (("--ssl-ca-certs", "ca.pem"), "need HTTPS"),
])
def test_bad_tls_settings_stop_the_server_in_one_line(args, words):
    proc = run_cli("serve", *ECHO, *args, "--port", "0")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert words in proc.stderr and "Traceback" not in proc.stderr


def test_root_path_for_a_proxy_that_strips_the_prefix(server_process):
    server = server_process(*ECHO, "--root-path", "/llm", "--api-key", "k")
    # The proxy forwards /llm/v1/... as /v1/...: routes, the key check and the open probes work as usual.
    assert httpx.get(server.url + "/health").status_code == 200
    models = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer k"})
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "echo"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    # Links the server hands out carry the prefix the client sees.
    spec = httpx.get(server.url + "/openapi.json", headers={"Authorization": "Bearer k"}).json()
    assert spec["servers"] == [{"url": "/llm"}]
