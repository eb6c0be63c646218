"""Resolving a Hub id against a fake Hub on loopback (in this process): what is fetched and what
never is, the cache hit, offline, the quant pick, gated repos, resuming a cut download, and the
one-line errors; nothing is written outside the cache."""

from __future__ import annotations

import logging
import os

import pytest

from repos import files_under, gguf_repo, safetensors_repo
from llmserve.errors import ConfigError
from llmserve.models import plan_model, resolve_model


def test_a_safetensors_repo_is_fetched_without_pickles_then_served_from_the_cache(hub_env, fake_hub, tmp_path,
                                                                                 monkeypatch):
    sha = fake_hub.add("org/tiny", safetensors_repo())
    resolved = resolve_model("org/tiny")
    cache = tmp_path / "hf" / "hub"
    assert resolved.path == str(cache / "models--org--tiny" / "snapshots" / sha)
    fetched = sorted(p.rsplit("/", 1)[-1] for p in fake_hub.gets())
    assert "model.safetensors" in fetched and "config.json" in fetched and "tokenizer.json" in fetched
    assert not any(name.endswith((".bin", ".md")) or "consolidated" in name for name in fetched), fetched
    assert (cache / "models--org--tiny" / "refs" / "main").read_text() == sha
    assert sorted(os.listdir(resolved.path)) == sorted(resolved.selection.files)
    # a second start is a cache hit: no request at all, online or offline
    before = len(fake_hub.requests)
    assert resolve_model("org/tiny").path == resolved.path
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("org/tiny").path == resolved.path
    assert len(fake_hub.requests) == before
    assert files_under(tmp_path) == [f"hf/hub/{p}" for p in files_under(cache)]  # nothing outside the cache


def test_offline_miss_is_one_line_naming_the_pull_command(hub_env, fake_hub, monkeypatch):
    fake_hub.add("org/tiny", safetensors_repo())
    with pytest.raises(ConfigError) as err:
        plan_model("org/tiny", offline=True, revision="v2")
    assert str(err.value).count("\n") == 0
    assert "org/tiny is not in the local Hugging Face cache" in str(err.value)
    assert "`llmserve pull org/tiny --revision v2`" in str(err.value) and "--offline" in str(err.value)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match=r"HF_HUB_OFFLINE=1 forbids downloads: fetch it first with "
                                          r"`llmserve pull org/tiny-GGUF:Q8_0`"):
        plan_model("org/tiny-GGUF:Q8_0")
    assert fake_hub.requests == []


def test_gguf_quant_pick_split_files_and_no_projector(hub_env, fake_hub, caplog):
    fake_hub.add("org/tiny-GGUF", gguf_repo())
    default = resolve_model("org/tiny-GGUF")
    assert default.path.endswith("/tiny-Q4_K_M.gguf") and default.selection.quant == "Q4_K_M"
    assert resolve_model("org/tiny-GGUF:q8_0").path.endswith("/tiny-Q8_0.gguf")  # case-insensitive
    split = resolve_model("hf.co/org/tiny-GGUF:F16")
    assert split.path.endswith("/tiny-F16-00001-of-00003.gguf") and split.name == "org/tiny-GGUF:F16"
    assert split.selection.files == [f"tiny-F16-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert all(os.path.isfile(os.path.join(split.snapshot, f)) for f in split.selection.files)
    fetched = [p.rsplit("/", 1)[-1] for p in fake_hub.gets()]
    assert not any("mmproj" in f or f.endswith(".md") for f in fetched), fetched
    assert len(fetched) == len(set(fetched)) == 5  # each file once
    with pytest.raises(ConfigError) as err:
        resolve_model("org/tiny-GGUF:Q3_K_S")
    assert str(err.value) == "no GGUF file of org/tiny-GGUF carries the quant Q3_K_S: it has F16, Q4_K_M, Q8_0"
    with_projector = plan_model("org/tiny-GGUF:Q8_0", mmproj=True).resolve(refresh=True)
    assert "mmproj-tiny-f16.gguf" in with_projector.selection.files


def test_without_q4_k_m_the_first_gguf_is_served_and_the_choice_logged(hub_env, fake_hub, caplog):
    files = {k: v for k, v in gguf_repo().items() if "Q4_K_M" not in k}
    fake_hub.add("org/other-GGUF", files)
    with caplog.at_level(logging.INFO, logger="llmserve.models"):
        resolved = resolve_model("org/other-GGUF")
    assert resolved.path.endswith("/tiny-F16-00001-of-00003.gguf")
    assert "no :QUANT given and no Q4_K_M file in org/other-GGUF: serving tiny-F16-00001-of-00003.gguf, the " \
           "first of 2 GGUF models" in caplog.text


def test_a_gated_repo_names_the_page_to_request_access(hub_env, fake_hub, tmp_path):
    from fake_hub import GOOD_TOKEN

    fake_hub.add("org/gated", safetensors_repo(), gated=True)
    with pytest.raises(ConfigError) as err:
        resolve_model("org/gated")
    assert str(err.value) == (f"org/gated is gated or private and this request has no access (HTTP 401): request "
                              f"access at {fake_hub.url}/org/gated and pass a token with --hf-token or HF_TOKEN")
    assert resolve_model("org/gated", token=GOOD_TOKEN).selection.kind == "safetensors"


def test_a_token_not_granted_access_names_the_page_and_hf_token_reaches_the_hub(hub_env, fake_hub, monkeypatch):
    from fake_hub import GOOD_TOKEN

    fake_hub.add("org/gated", safetensors_repo(), gated=True)
    with pytest.raises(ConfigError) as err:
        resolve_model("org/gated", token="hf_not_granted")
    assert str(err.value) == (f"org/gated is gated and the token sent has not been granted access (HTTP 403): "
                              f"request access at {fake_hub.url}/org/gated with the account the token belongs to, "
                              f"or pass another token with --hf-token or HF_TOKEN")
    # No --hf-token: huggingface_hub sends HF_TOKEN, on every request (the listing and each file).
    monkeypatch.setenv("HF_TOKEN", GOOD_TOKEN)
    fake_hub.tokens.clear()
    assert resolve_model("org/gated").selection.kind == "safetensors"
    assert fake_hub.gets() and fake_hub.tokens == [f"Bearer {GOOD_TOKEN}"] * len(fake_hub.tokens)


def test_a_file_the_repo_lists_but_the_hub_does_not_serve_is_one_line(hub_env, fake_hub):
    fake_hub.add("org/tiny", safetensors_repo())
    fake_hub.missing.add("model.safetensors")
    with pytest.raises(ConfigError) as err:
        resolve_model("org/tiny")
    assert str(err.value) == ("org/tiny lists model.safetensors but the Hub does not serve it (HTTP 404); "
                              "retry later")


def test_a_pickle_only_repo_is_refused_before_any_file_is_fetched(hub_env, fake_hub, tmp_path):
    fake_hub.add("org/pickled", {"config.json": b"{}", "pytorch_model.bin": b"x", "model.pt": b"y"})
    with pytest.raises(ConfigError, match=r"^org/pickled has only pickled weights \(.*\), which llmserve never "
                                          r"loads \(unpickling runs code\)"):
        resolve_model("org/pickled")
    assert fake_hub.gets() == [] and files_under(tmp_path / "hf" / "hub") == []


def test_a_download_cut_mid_file_resumes_with_a_range_request(hub_env, fake_hub):
    # huggingface_hub reads 10 MB chunks: a cut after the first one resumes where it stopped.
    blob = os.urandom(24 * 1024 * 1024)
    fake_hub.add("org/big", {"config.json": b"{}", "model.safetensors": blob})
    fake_hub.cut_once.add("model.safetensors")
    resolved = resolve_model("org/big")
    with open(os.path.join(resolved.path, "model.safetensors"), "rb") as fh:
        assert fh.read() == blob
    ranges = [r for m, p, r in fake_hub.requests if m == "GET" and p.endswith("model.safetensors")]
    assert ranges[0] is None and len(ranges) == 2
    start = int(ranges[1].removeprefix("bytes=").rstrip("-"))
    assert 0 < start <= len(blob) // 2, ranges  # resumed, not restarted


@pytest.mark.parametrize("text", [
    "org/../../etc", "/etc/passwd/x:y", "org/repo:Q4:../../x", "org/re..po", "org//repo", "org/repo:../x",
    "a/b/c:Q4_K_M", "x" * 1_000_000 + "/y", "org/repo\x00", "org/-repo",
])
def test_bad_ids_are_one_line_and_touch_nothing(hub_env, fake_hub, tmp_path, monkeypatch, text):
    monkeypatch.chdir(tmp_path)
    try:
        source = plan_model(text)
    except ConfigError as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 300
    else:
        assert source.ref is None  # a path: the backend says it does not exist
    assert fake_hub.requests == [] and files_under(tmp_path) == []


def test_a_bad_revision_and_a_missing_revision(hub_env, fake_hub):
    fake_hub.add("org/tiny", safetensors_repo())
    with pytest.raises(ConfigError, match=r"--revision '\.\./\.\./x' is not a branch, tag or commit name"):
        plan_model("org/tiny", revision="../../x")
    with pytest.raises(ConfigError, match=r"^org/tiny has no revision 'v9' on http://127\.0\.0\.1:\d+: check "):
        resolve_model("org/tiny", revision="v9")


def test_unknown_repo_huge_listing_and_no_network_are_one_line(hub_env, fake_hub, monkeypatch):
    with pytest.raises(ConfigError, match=r"^no model repo org/nope on http://127\.0\.0\.1:\d+: check the id"):
        resolve_model("org/nope")
    fake_hub.add("org/huge", {f"shard-{i:05d}.safetensors": b"" for i in range(10_001)})
    with pytest.raises(ConfigError, match=r"^org/huge lists 10001 files, more than a model repo holds"):
        resolve_model("org/huge")
    assert fake_hub.gets() == []
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    with pytest.raises(ConfigError) as err:
        resolve_model("org/tiny")
    assert str(err.value).startswith("cannot fetch org/tiny from http://127.0.0.1:9: ConnectError") \
        and "check the network, or serve a cached model" in str(err.value) and "\n" not in str(err.value)


def test_a_local_path_wins_over_a_repo_id_of_the_same_spelling(hub_env, fake_hub, tmp_path, monkeypatch, caplog):
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.INFO, logger="llmserve.models"):
        source = plan_model("org/tiny")
    assert source.ref is None and source.resolve().path == "org/tiny"
    assert "'org/tiny' is a local path and also a Hugging Face repo id: serving the local path" in caplog.text
    assert fake_hub.requests == []
