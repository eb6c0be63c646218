"""Start-up that talks: the port is bound first, probes answer while the model loads, slow phases
report progress (a live line on a terminal, plain lines in a log), a ready summary, and errors a
user can act on, each one line."""

from __future__ import annotations

import io
import json
import re
import shutil
import socket
import subprocess
import sys
import time
from datetime import datetime

import httpx
import pytest

from conftest import ECHO_PLUGIN, ROOT, ServerProcess, free_port, run_cli

ECHO = ("--backend", "echo", "--plugin", ECHO_PLUGIN)
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO llmserve\.progress: (.+?): (.*)$")


def one_line_error(out: subprocess.CompletedProcess) -> str:
    """The process failed with exactly one line on stderr, ``error: ...``, and no traceback."""
    assert out.returncode != 0, out.stderr
    assert "Traceback" not in out.stderr and "Traceback" not in out.stdout, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.stderr
    return errors[0]


# ---- the port ---------------------------------------------------------------------------------

def test_a_busy_port_fails_at_once_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        # A load that would take a minute: the failure must come before it starts.
        out = run_cli("serve", *ECHO, "--port", str(port), env={"LLMSERVE_ECHO_LOAD_DELAY": "60"}, timeout=60)
        took = time.monotonic() - started
    line = one_line_error(out)
    assert f"127.0.0.1:{port}" in line and "already in use" in line and "--port" in line
    assert "loading" not in out.stderr and "Application startup" not in out.stderr, out.stderr
    assert took < 10, took


# ---- while the model loads --------------------------------------------------------------------

@pytest.fixture(scope="module")
def slow_start():
    """An echo server whose load takes 4 s, watched from its first answer to ready."""
    server = ServerProcess(*ECHO, env={"LLMSERVE_ECHO_LOAD_DELAY": "4"})
    seen: dict[str, object] = {}
    try:
        deadline = time.time() + 120
        while time.time() < deadline:  # the first answer to anything: liveness
            assert server.proc.poll() is None, server.log
            try:
                seen["health"] = httpx.get(server.url + "/health", timeout=1).status_code
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        # The load thread starts with the server: /ready says "loading" at once and names the
        # load's phase as soon as it has begun (polled, never assumed to have begun already).
        while time.time() < deadline:
            seen["ready"] = reply = httpx.get(server.url + "/ready", timeout=5)
            if reply.status_code != 503 or "progress" in reply.json():
                break
            assert reply.json() == {"status": "not ready", "reason": "loading"}, reply.text
            time.sleep(0.02)
        seen["openai"] = httpx.get(server.url + "/v1/models", timeout=5)
        seen["tgi"] = httpx.post(server.url + "/generate", json={"inputs": "hi"}, timeout=5)
        seen["anthropic"] = httpx.post(server.url + "/v1/messages", timeout=5, json={
            "model": "echo", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        seen["triton_live"] = httpx.get(server.url + "/v2/health/live", timeout=5)
        seen["triton_ready"] = httpx.get(server.url + "/v2/health/ready", timeout=5)
        seen["ready_before"] = httpx.get(server.url + "/ready", timeout=5).status_code
        server.wait_ready(timeout=120)
        seen["models_after"] = httpx.get(server.url + "/v1/models", timeout=5)
        time.sleep(0.5)
        yield server, seen
    finally:
        server.stop()


def test_health_is_alive_and_ready_says_loading_during_the_load(slow_start):
    server, seen = slow_start
    assert seen["health"] == 200
    ready = seen["ready"]
    assert ready.status_code == 503
    body = ready.json()
    assert body["status"] == "not ready" and body["reason"] == "loading"
    assert body["progress"].startswith("loading echo weights: ")  # what the load is doing now
    assert seen["triton_live"].status_code == 200 and seen["triton_live"].json() == {"live": True}
    assert seen["triton_ready"].status_code == 503 and seen["triton_ready"].json() == {"ready": False}
    # Then ready, and the routes serve.
    assert httpx.get(server.url + "/ready").json() == {"status": "ready"}
    assert seen["models_after"].status_code == 200


def test_routes_that_need_the_model_answer_503_in_their_dialect(slow_start):
    _, seen = slow_start
    openai_reply = seen["openai"]
    assert openai_reply.status_code == 503 and openai_reply.headers["retry-after"] == "5"
    assert "still loading" in openai_reply.json()["error"]["message"]
    tgi = seen["tgi"]
    assert tgi.status_code == 503 and "still loading" in tgi.json()["error"]
    assert tgi.json()["error_type"] == "unavailable"  # not a failed generation
    anthropic = seen["anthropic"]
    # Anthropic's overload status, which its SDK retries; never a 500 api_error
    assert anthropic.status_code == 529 and anthropic.json()["type"] == "error"
    assert anthropic.json()["error"]["type"] == "overloaded_error"
    assert "still loading" in anthropic.json()["error"]["message"]


def test_the_openai_client_sees_a_retryable_503_while_loading():
    openai = pytest.importorskip("openai")
    server = ServerProcess(*ECHO, env={"LLMSERVE_ECHO_LOAD_DELAY": "30"})
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                client.models.list()
                pytest.fail("the model list was served before the model loaded")
            except openai.APIConnectionError:
                time.sleep(0.1)
            except openai.APIStatusError as exc:
                assert exc.status_code == 503 and "still loading" in exc.message
                break
    finally:
        server.stop()


def test_a_log_file_gets_plain_progress_lines_and_a_ready_summary(slow_start):
    server, _ = slow_start
    log = server.log
    assert "\r" not in log
    lines = [m.groups() for m in map(STAMP.match, log.splitlines()) if m]
    assert any(name == "loading echo weights" and text.startswith("done in") for _, name, text in lines), log
    periodic: dict[str, list[datetime]] = {}
    for stamp, name, text in lines:
        if not text.startswith("done in"):
            periodic.setdefault(name, []).append(datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f"))
    assert periodic.get("loading echo weights"), log  # a 4 s phase says how far it is
    for name, times in periodic.items():  # at most one line per second per phase
        assert all((b - a).total_seconds() >= 1.0 for a, b in zip(times, times[1:])), (name, times)
    assert re.search(r"llmserve\.server: ready in \d+\.\d s", log), log
    assert re.search(r"KV pool +\d+ blocks x 16 tokens = \d+ tokens", log), log
    assert re.search(r"context 512 tokens", log), log
    for dialect in ("openai", "tgi", "anthropic", "ollama", "triton"):
        assert re.search(rf"  {dialect} +{re.escape(server.url)}/ ", log), (dialect, log)


# ---- the progress reporter itself -------------------------------------------------------------

class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_one_live_line_redrawn_in_place(monkeypatch):
    from llmserve import progress

    monkeypatch.delenv("LLMSERVE_PROGRESS", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    screen = FakeTerminal()
    reporter = progress.Reporter(screen)
    assert reporter.live
    with reporter.phase("compiling the CPU kernel demo", total=4, unit="steps") as phase:
        for _ in range(4):
            time.sleep(0.25)
            phase.advance()
    drawn = screen.getvalue()
    assert "\n" not in drawn  # never a new line: each update overwrites the last
    assert drawn.count("\r\x1b[2K") >= 3 and "compiling the CPU kernel demo: " in drawn
    assert drawn.endswith("\r\x1b[2K")  # the line is gone once the phase ends


def test_tqdm_bars_become_phases(monkeypatch):
    from llmserve import progress

    monkeypatch.setattr(progress, "_reporter", progress.Reporter(io.StringIO(), "plain"))
    bar = progress.bar_factory()
    seen = []
    for _ in bar(range(3), desc="Converting and de-quantizing GGUF tensors..."):
        seen.append(progress.reporter().current().describe())
    assert seen[0].startswith("Converting and de-quantizing GGUF tensors: 0/3 (0%)")
    assert seen[2].startswith("Converting and de-quantizing GGUF tensors: 2/3")
    assert progress.reporter().current() is None


def test_transformers_bars_go_to_the_reporter_while_loading():
    pytest.importorskip("transformers")
    import transformers.utils.logging as hf_logging

    from llmserve.plugins.backends.torch.loader import quiet_bars

    with quiet_bars():
        bar = hf_logging.tqdm(range(2), desc="Loading weights")
        assert type(bar).__name__ == "Bar"
        list(bar)
    assert type(hf_logging.tqdm(range(2), disable=True)).__name__ != "Bar"


# ---- errors a user can act on -----------------------------------------------------------------

def serve_fails(*args: str, env: dict[str, str] | None = None) -> str:
    out = run_cli("serve", *args, "--port", str(free_port()), "--device", "cpu", env=env, timeout=300)
    return one_line_error(out)


def test_a_model_path_that_does_not_exist(tmp_path):
    line = serve_fails(str(tmp_path / "no-such-model"))
    assert "does not exist" in line and ".gguf" in line and "config.json" in line
    assert "Repo id" not in line


def test_a_hub_id_missing_from_the_cache_offline_names_the_pull_command(tmp_path):
    line = serve_fails("acme-research/tiny-chat-7b", env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)})
    assert line == (f"error: acme-research/tiny-chat-7b is not in the local Hugging Face cache ({tmp_path}/hub) "
                    "and HF_HUB_OFFLINE=1 forbids downloads: fetch it first with "
                    "`llmserve pull acme-research/tiny-chat-7b`")


def test_an_architecture_transformers_does_not_know(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "frobnicator",
                                                      "architectures": ["FrobnicatorForCausalLM"]}))
    line = serve_fails(str(tmp_path))
    assert "'frobnicator'" in line and "upgrade transformers" in line


def test_a_gguf_architecture_that_cannot_be_read(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "rwkv6")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    line = serve_fails(str(path), "--cache-dir", str(tmp_path / "cache"))
    assert "'rwkv6'" in line and "Hugging Face directory" in line


def test_too_little_memory_for_the_kv_pool(tmp_path):
    pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "tests" / "backends"))
    from test_torch_paged import build_tiny_model

    build_tiny_model(str(tmp_path))
    line = serve_fails(str(tmp_path), "--dtype", "float32", "--num-kv-blocks", "100000000000")
    assert "cannot allocate a KV cache" in line and "fewer KV blocks" in line


def test_out_of_memory_while_loading_is_one_line():
    from llmserve.errors import ConfigError
    from llmserve.server.startup import as_startup_error

    error = as_startup_error(MemoryError())
    assert isinstance(error, ConfigError) and "not enough memory" in str(error) and "--num-kv-blocks" in str(error)
    assert as_startup_error(KeyError("a bug")) is None  # a bug keeps its traceback


# ---- llmserve warmup --------------------------------------------------------------------------

def test_warmup_builds_the_kernels_and_converts_the_model(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    sys.path.insert(0, str(ROOT / "tests" / "backends"))
    from test_torch_loader import build_tiny

    import transformers

    from llmserve.config import load_config
    from llmserve.hooks.manager import PluginManager
    from llmserve.plugins.backends.torch.native import build
    from llmserve.warmup import warm_up

    # A ".gguf" whose conversion is a tiny HF model (no real GGUF needed to prove the cache fills).
    source = tmp_path / "src"
    build_tiny(str(source))
    gguf = tmp_path / "tiny.Q8_0.gguf"
    gguf.write_bytes(b"GGUF stand-in")
    real_model, real_tok = transformers.AutoModelForCausalLM.from_pretrained, transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda path, *a, gguf_file=None, **k: real_model(str(source) if gguf_file else path, *a, **k))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda path, *a, gguf_file=None, **k: real_tok(str(source) if gguf_file else path, *a, **k))
    built: list[str] = []
    # The kernels' own modules, imported first: one imported under the patch below would keep the
    # stand-in as its `library` for the rest of the process (later tests lose the native path).
    from llmserve.plugins.backends.torch.native import gguf_ops, ops, step
    assert gguf_ops.library is ops.library is step.library is build.library
    monkeypatch.setattr(build, "library", lambda name, what: built.append(name) or None)
    config, _ = load_config({"model": str(gguf), "cache_dir": str(tmp_path / "cache")}, environ={})
    warm_up(config, PluginManager().load(autoload=False))
    # Every kernel is asked for (some twice: the GGUF path asks for its own before choosing).
    assert sorted(set(built)) == build.kernel_names() and "packed_linear" in built
    converted = list((tmp_path / "cache" / "converted").glob("*/config.json"))
    assert len(converted) == 1  # the next start reads this instead of converting


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a cold warm-up compiles every kernel and converts the model's tokenizer
def test_a_serve_after_warmup_builds_and_converts_nothing(tmp_path):
    from llmserve.plugins.backends.torch.native import build

    # A kernel cache of its own, holding what this machine has built already (a cold build of
    # every kernel, a minute here, is what test_warmup_builds_the_kernels_and_converts_the_model
    # asks of the warm-up; whatever is missing is built by the warm-up below, not by the serve).
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    for built in build._cache_dir().glob("*.so"):
        shutil.copy2(built, kernels / built.name)
    env = {"LLMSERVE_KERNEL_CACHE": str(kernels)}
    out = run_cli("warmup", "--cache-dir", str(tmp_path / "cache"), env=env, timeout=900)
    assert out.returncode == 0, out.stderr
    assert "GGUF metadata and tokenizer" in out.stderr and "native CPU kernels: " in out.stderr
    assert "\r" not in out.stderr  # the GGUF reader's tqdm bar went through the reporter
    server = ServerProcess("--cache-dir", str(tmp_path / "cache"), "--dtype", "float32", "--max-model-len", "1024",
                           env=env)
    try:
        server.wait_ready(timeout=600)
    finally:
        log = server.stop()
    assert "read from the file" in log and "GGUF metadata and tokenizer" not in log
    assert "compiling the CPU kernel" not in log
    assert not (tmp_path / "cache" / "converted").exists()  # served in its own quantization: no fp32 copy
    assert "\r" not in log
    assert re.search(r"packing weights: done in \d", log) or "packing weights" not in log
