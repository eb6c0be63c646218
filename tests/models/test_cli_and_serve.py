"""``llmserve pull`` / ``ls`` / ``rm`` and ``llmserve serve <hub id>`` as a user runs them (in
subprocesses, output to pipes as in a log) against a fake Hub on loopback."""

from __future__ import annotations

import json
import re
from datetime import datetime

import httpx

from repos import Server, cli, files_under, gguf_repo, safetensors_repo


def gaps(log: str) -> list[float]:
    """Seconds between consecutive timestamped log lines."""
    stamps = [datetime.strptime(m, "%Y-%m-%d %H:%M:%S") for m in re.findall(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)",
                                                                           log, re.M)]
    return [(b - a).total_seconds() for a, b in zip(stamps, stamps[1:])]


def test_pull_logs_each_file_and_a_periodic_percentage_then_ls_and_rm(hub_env, fake_hub, tmp_path):
    fake_hub.add("org/tiny", safetensors_repo())
    fake_hub.chunk_delay = 0.5  # ~7 s for the weights
    out = cli("pull", "org/tiny", env=hub_env)
    assert out.returncode == 0, out.stderr
    log = out.stderr
    assert "\r" not in log
    for number, name in enumerate(["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                                   "tokenizer_config.json"], 1):
        assert re.search(rf"fetching org/tiny: {re.escape(name)} \([\d.]+ MB\), file {number} of 5", log), log
    assert re.search(r"fetching org/tiny model\.safetensors: [\d.]+/0\.1 MB \(\d+%\), \d+ s", log), log
    assert max(gaps(log)) <= 10, log
    assert out.stdout.startswith("org/tiny: ") and out.stdout.strip().endswith("/snapshots/" + fake_hub.repos[
        "org/tiny"].sha)

    fake_hub.chunk_delay = 0
    fake_hub.add("org/tiny-GGUF", gguf_repo())
    pulled = json.loads(cli("pull", "org/tiny-GGUF:Q8_0", "--json", env=hub_env).stdout)
    assert pulled["quant"] == "Q8_0" and pulled["files"] == ["tiny-Q8_0.gguf"] and pulled["fetched"] is True
    assert cli("pull", "org/tiny-GGUF:F16", env=hub_env).returncode == 0

    listed = {m["name"]: m for m in json.loads(cli("ls", "--json", env=hub_env).stdout)}
    assert sorted(listed) == ["org/tiny", "org/tiny-GGUF:F16", "org/tiny-GGUF:Q8_0"]
    assert listed["org/tiny"]["architecture"] == "LlamaForCausalLM" and listed["org/tiny"]["quant"] is None
    assert listed["org/tiny-GGUF:F16"]["files"] == [f"tiny-F16-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert listed["org/tiny-GGUF:F16"]["architecture"] == "llama"
    assert listed["org/tiny-GGUF:Q8_0"]["size"] == len(gguf_repo()["tiny-Q8_0.gguf"])
    assert all(m["last_used"] > 0 for m in listed.values())
    table = cli("ls", env=hub_env).stdout.splitlines()
    assert table[0].split() == ["NAME", "ARCHITECTURE", "QUANT", "SIZE", "LAST", "USED", "FILES"]
    assert any(line.startswith("org/tiny-GGUF:Q8_0") and "llama" in line and "tiny-Q8_0.gguf" in line
               for line in table)

    removed = json.loads(cli("rm", "org/tiny-GGUF:Q8_0", "--json", env=hub_env).stdout)
    assert removed == {"name": "org/tiny-GGUF:Q8_0", "removed": ["tiny-Q8_0.gguf"]}
    cache = tmp_path / "hf" / "hub" / "models--org--tiny-GGUF"
    blobs = list((cache / "blobs").iterdir())
    assert len(blobs) == 3  # the split model's three parts remain; the Q8_0 blob is gone
    assert cli("rm", "org/tiny", env=hub_env).stdout.strip() == "removed org/tiny (5 files)"
    assert not (tmp_path / "hf" / "hub" / "models--org--tiny").exists()
    again = cli("rm", "org/tiny", env=hub_env)
    assert again.returncode == 1 and again.stderr.startswith("error: org/tiny is not in the Hugging Face cache")
    bad = cli("rm", "../../etc", env=hub_env)
    assert bad.returncode == 1 and "is not a Hugging Face repo id" in bad.stderr
    offline = cli("pull", "org/tiny", env={**hub_env, "HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 1 and "`llmserve pull` needs the network, and HF_HUB_OFFLINE is set" in offline.stderr


def test_serve_a_hub_id_ready_says_what_is_fetched_then_serves_it(hub_env, fake_hub):
    fake_hub.add("org/tiny", safetensors_repo())
    fake_hub.chunk_delay = 0.4
    server = Server("org/tiny", "--dtype", "float32", env=hub_env)
    try:
        seen: list[dict] = []

        def fetching() -> bool:
            try:
                reply = httpx.get(server.url + "/ready", timeout=2)
            except httpx.HTTPError:
                return False
            seen.append({**reply.json(), "http": reply.status_code})
            return "fetching org/tiny" in reply.json().get("progress", "")

        server.wait(fetching, timeout=120)
        assert seen[-1]["http"] == 503 and seen[-1]["reason"] == "loading"
        assert re.match(r"fetching org/tiny \S+: ", seen[-1]["progress"]), seen[-1]
        server.wait(lambda: httpx.get(server.url + "/ready", timeout=2).status_code == 200, timeout=300)
        reply = httpx.post(server.url + "/v1/completions", json={"model": "org/tiny", "prompt": "t5 t6",
                                                                 "max_tokens": 3, "temperature": 0}, timeout=60)
        assert reply.status_code == 200 and reply.json()["model"] == "org/tiny", reply.text
        models = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == ["org/tiny"] and "/snapshots/" in models[0]["root"]
    finally:
        server.stop()
    assert "fetching org/tiny: model.safetensors" in server.log


def test_serve_a_split_gguf_from_the_hub_and_an_offline_miss(hub_env, fake_hub, tmp_path):
    fake_hub.add("org/tiny-GGUF", gguf_repo())
    server = Server("org/tiny-GGUF:F16", env=hub_env)
    try:
        server.wait(lambda: b"ready in" in server.log.encode(), timeout=300)
        reply = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4,
                                                                 "temperature": 0}, timeout=60)
        assert reply.status_code == 200 and reply.json()["model"] == "org/tiny-GGUF:F16", reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
    finally:
        server.stop()
    assert "tiny-F16-00001-of-00003.gguf" in server.log
    # The repo's vision projector came with it (this one is no real file: logged, the model serves text).
    assert "mmproj-tiny-f16.gguf" in "".join(fake_hub.gets())
    assert "mmproj-tiny-f16.gguf" in server.log and "serving text only" in server.log
    miss = cli("serve", "org/tiny-GGUF:Q8_0", "--offline", "--port", "0", env=hub_env)
    assert miss.returncode == 2
    assert miss.stderr.strip().splitlines()[-1] == (
        f"error: org/tiny-GGUF:Q8_0 is not in the local Hugging Face cache ({tmp_path}/hf/hub) and --offline "
        "forbids downloads: fetch it first with `llmserve pull org/tiny-GGUF:Q8_0`")
    stored = [f.split("/")[-1] for f in files_under(tmp_path / "hf" / "hub" / "models--org--tiny-GGUF" / "snapshots")]
    assert stored == ["mmproj-tiny-f16.gguf", *(f"tiny-F16-0000{i}-of-00003.gguf" for i in (1, 2, 3))]
