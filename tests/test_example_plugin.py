"""The example third-party package round trip: install it, list it, serve its route, block it."""

import json
import subprocess
import sys

import httpx
import pytest

from conftest import ECHO_PLUGIN, EXAMPLE_PLUGIN, run_cli


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """pip-install examples/llmserve-acme into a private target dir (local, no network)."""
    target = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(target), str(EXAMPLE_PLUGIN)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return {"PYTHONPATH": str(target)}


def test_plugins_json_lists_the_installed_package(installed):
    result = run_cli("plugins", "--json", env=installed)
    assert result.returncode == 0, result.stderr
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    acme = rows["acme"]
    assert acme["source"] == "entrypoint"
    assert acme["distribution"] == "llmserve-acme" and acme["version"] == "0.2.0"
    assert acme["contributes"] == {"protocol": ["acme"], "tool_parser": ["acme"], "proposer": ["acme-replay"]}
    text = run_cli("plugins", env=installed).stdout
    assert "acme  [entrypoint]  llmserve-acme 0.2.0" in text


def test_running_server_serves_the_plugin_route_and_no_blocks_it(installed, server_process):
    server = server_process("--backend", "echo", "--plugin", ECHO_PLUGIN, env=installed)
    reply = httpx.post(server.url + "/acme/shout", json={"text": "plugins work"}, timeout=30)
    assert reply.status_code == 200
    assert reply.json()["shout"] == "PLUGINS WORK!"
    blocked = server_process("--backend", "echo", "--plugin", ECHO_PLUGIN, "--plugin", "no:acme", env=installed)
    assert httpx.post(blocked.url + "/acme/shout", json={"text": "x"}, timeout=30).status_code == 404
    listed = {row["name"] for row in json.loads(run_cli("plugins", "--json", "--plugin", "no:acme",
                                                        env=installed).stdout)}
    assert "acme" not in listed


def test_the_example_tool_parser_through_the_registry(installed, monkeypatch):
    monkeypatch.syspath_prepend(installed["PYTHONPATH"])
    from llmserve.hooks.manager import PluginManager
    from llmserve.hooks.registry import Registry

    pm = PluginManager().load([("acme", "cli")], autoload=False)
    parser_cls = Registry.collect(pm).load("tool_parser", "acme")
    parser = parser_cls()
    out = parser.feed('hello\nCALL get_weather {"city": "Paris"}\n')
    end = parser.finish()
    assert out.content == "hello\n"
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls + end.tool_calls] == [
        ("get_weather", {"city": "Paris"})]


def test_the_example_proposer_speculates_in_process(monkeypatch):
    """The test kit of docs/writing-a-plugin.md for a proposer: the echo backend repeats its
    prompt, acme-replay proposes exactly that, and the server's counters show the proposals
    verified and kept; the output is the prompt, as without speculation."""
    from fastapi.testclient import TestClient

    from llmserve import PluginManager, build_server
    from llmserve.config import load_config

    monkeypatch.syspath_prepend(str(EXAMPLE_PLUGIN))
    config, _ = load_config({"backend": "echo", "plugins": [ECHO_PLUGIN, "llmserve_acme"],
                             "speculative_config": {"method": "acme-replay", "num_speculative_tokens": 4}},
                            environ={})
    app, _ = build_server(config, PluginManager().load(autoload=False))
    with TestClient(app, raise_server_exceptions=False) as client:
        reply = client.post("/v1/completions", json={"model": "echo", "prompt": "speculate, then verify",
                                                     "max_tokens": 40, "temperature": 0})
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "speculate, then verify"
        lines = client.get("/metrics").text.splitlines()
    metrics = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("vllm:spec_decode_num_")}
    # 22 prompt tokens and EOS out: one sampled by the model in each of its 7 steps (the prompt's,
    # then six verifying 1, 2, 3, 4, 4 and 2 proposals, every one kept), 16 proposed.
    assert metrics["vllm:spec_decode_num_drafts_total"] == 6
    assert metrics["vllm:spec_decode_num_accepted_tokens_total"] == 16
    assert metrics["vllm:spec_decode_num_draft_tokens_total"] == 16
