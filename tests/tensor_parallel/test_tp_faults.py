"""A tensor-parallel worker that dies fails the server as an engine fault does: the requests in
flight get an error in their dialect's format, /ready answers 503, the process exits non-zero,
and no worker process outlives it."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

psutil = pytest.importorskip("psutil")
openai = pytest.importorskip("openai")

from conftest import ServerProcess

pytestmark = pytest.mark.timeout(600)  # each test starts a two-process server


def workers(pid: int) -> list["psutil.Process"]:
    """The spawned rank processes of server ``pid`` (not multiprocessing's resource tracker)."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for child in children:
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                out.append(child)
        except psutil.NoSuchProcess:
            pass
    return out


def serve(model: str) -> ServerProcess:
    return ServerProcess("--model", model, "--tensor-parallel-size", "2", "--device", "cpu", "--dtype", "float32",
                         "--max-model-len", "512", "--log-level", "info")


def assert_gone(server: ServerProcess, children: list["psutil.Process"]) -> str:
    """The server exits non-zero and none of ``children`` (its ranks and what they started) survives."""
    code = server.proc.wait(timeout=60)
    log = server.stop()
    assert code != 0, log
    _, alive = psutil.wait_procs(children, timeout=15)
    assert alive == [], f"processes left behind: {alive}\n{log}"
    return log


def test_killing_a_worker_mid_generation_fails_the_server(tiny_6_3):
    server = serve(tiny_6_3)
    server.wait_ready(timeout=300)
    ranks = workers(server.proc.pid)
    assert len(ranks) == 1
    children = ranks + ranks[0].children(recursive=True)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    seen: list[int | str] = []
    failed = threading.Event()

    def poll_ready() -> None:
        # From the moment the client has its error until the process is gone, /ready never says 200:
        # 503 (engine dead) while the server lingers to answer, then nothing listens (a poll that
        # lands while the process exits sees its connection dropped: a read or protocol error).
        failed.wait()
        while server.proc.poll() is None or not seen:
            try:
                seen.append(httpx.get(server.url + "/ready", timeout=2).status_code)
            except httpx.HTTPError as exc:
                seen.append(type(exc).__name__)
            time.sleep(0.01)

    poller = threading.Thread(target=poll_ready)
    poller.start()
    text = []
    try:
        with pytest.raises(openai.APIError) as err:
            stream = client.completions.create(model=client.models.list().data[0].id, prompt="t5 t6 t7",
                                               max_tokens=480, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
            for chunk in stream:
                text.append(chunk.choices[0].text)
                if len(text) == 5:
                    ranks[0].kill()
    finally:
        failed.set()
    assert 5 <= len(text) < 480
    assert "restarting" in str(err.value), err.value
    log = assert_gone(server, children)
    poller.join(10)
    gone = ("ConnectError", "ReadError", "RemoteProtocolError")
    assert seen and all(s == 503 or s in gone for s in seen), seen
    assert "tensor-parallel rank" in log and "engine loop died" in log


def test_killing_a_worker_during_the_load_fails_the_start(tiny_6_3):
    server = serve(tiny_6_3)
    deadline = time.time() + 120
    while not (ranks := workers(server.proc.pid)):
        assert time.time() < deadline and server.proc.poll() is None, server.stop()
        time.sleep(0.05)
    children = ranks + ranks[0].children(recursive=True)
    ready = None
    while ready is None and time.time() < deadline:
        try:
            ready = httpx.get(server.url + "/ready", timeout=2).status_code
        except httpx.HTTPError:
            time.sleep(0.05)
    assert ready == 503  # still loading: the worker is importing torch or loading its shard
    ranks[0].kill()
    log = assert_gone(server, children)
    assert "tensor-parallel rank 1 died" in log, log


def test_a_worker_that_dies_while_idle_fails_the_server(tiny_6_3):
    server = serve(tiny_6_3)
    server.wait_ready(timeout=300)
    ranks = workers(server.proc.pid)
    children = ranks + ranks[0].children(recursive=True)
    ranks[0].kill()  # no request in flight: the watcher, not a collective, notices
    log = assert_gone(server, children)
    assert "tensor-parallel rank 1 died (exit code -9)" in log and "engine loop died" in log, log


def test_sigterm_stops_every_rank_and_exits_0(tiny_6_3):
    server = serve(tiny_6_3)
    server.wait_ready(timeout=300)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    done = client.completions.create(model=client.models.list().data[0].id, prompt="t5 t6 t7", max_tokens=8,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 8
    ranks = workers(server.proc.pid)
    children = ranks + ranks[0].children(recursive=True)
    server.proc.terminate()
    # Generous: the exit also waits for a native-kernel build still running from the start.
    assert server.proc.wait(timeout=240) == 0, server.stop()
    _, alive = psutil.wait_procs(children, timeout=15)
    assert alive == [], server.stop()
