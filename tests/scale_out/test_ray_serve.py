"""`llmserve ray-serve`: two replicas of the embedded model behind Ray Serve's HTTP proxy.

Ray lives in a venv of its own (``.venv-ray``, made by ``make test``), so the command runs
there as a subprocess; this test talks to Ray's proxy with the real OpenAI and TGI clients.
It checks that both replicas serve (each response names its replica in a header, and each
replica's own /metrics counts what it served), that killing one replica's process loses no
request and Ray starts a new one, and that stopping the command leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from conftest import ROOT, free_port

openai = pytest.importorskip("openai")
text_generation = pytest.importorskip("text_generation")
parser = pytest.importorskip("prometheus_client.parser")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPLICA = "x-llmserve-replica"


def ray_llmserve() -> Path:
    binary = Path(os.environ.get("LLMSERVE_RAY_BIN") or ROOT / ".venv-ray" / "bin" / "llmserve")
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        message = (f"{binary} is missing: `make test` builds .venv-ray (python -m venv .venv-ray && "
                   ".venv-ray/bin/pip install -e '.[ray]'), or set LLMSERVE_RAY_BIN")
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return binary


def descendants(root: int) -> set[int]:
    """Every live process below ``root`` (Ray's raylet, GCS, workers and replicas)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    """The processes of ``pids`` that still run (zombies waiting to be reaped do not)."""
    out = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.add(pid)
    return out


def replica_pids(root: int) -> list[int]:
    out = []
    for pid in descendants(root):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if cmdline.startswith(b"ray::ServeReplica:llmserve:"):
            out.append(pid)
    return sorted(out)


class RayServe:
    """``llmserve ray-serve`` in a subprocess, its output collected as it comes."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}
        self.proc = subprocess.Popen([str(ray_llmserve()), "ray-serve", "--host", "127.0.0.1", "--port",
                                      str(self.port), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, cwd=ROOT, start_new_session=True)
        self.lines: list[str] = []
        self.serving = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if "through Ray Serve" in line:
                self.serving.set()

    @property
    def log(self) -> str:
        return "".join(self.lines[-200:])

    def wait_serving(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while not self.serving.wait(1):
            assert self.proc.poll() is None, f"ray-serve exited with {self.proc.returncode}:\n{self.log}"
            assert time.time() < deadline, f"ray-serve did not come up in {timeout:.0f} s:\n{self.log}"


def replica_of_health(url: str) -> str:
    r = httpx.get(url + "/health", timeout=30)
    assert r.status_code == 200, r.text
    return r.headers[REPLICA]


def success_count(text: str) -> float:
    for family in parser.text_string_to_metric_families(text):
        if family.name == "vllm:request_success":
            return sum(s.value for s in family.samples if s.name == "vllm:request_success_total")
    raise AssertionError("no vllm:request_success_total on /metrics")


def test_two_replicas_behind_ray_serve_survive_a_killed_replica():
    server = RayServe("--replicas", "2", "--replica-cpus", "1", "--torch-threads", "1", "--num-kv-blocks", "64",
                      "--max-model-len", "512", "--max-num-seqs", "8", "--dtype", "float32",
                      "--health-check-period", "2", "--log-level", "warning")
    started: set[int] = set()
    try:
        server.wait_serving(timeout=400)
        started = descendants(server.proc.pid)
        oai = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        tgi = text_generation.Client(server.url, timeout=120)
        model = oai.models.list().data[0].id

        def ask(i: int) -> str | None:
            """One request, alternating dialects; the replica that answered (OpenAI's header)."""
            if i % 2:
                out = tgi.generate("The capital of France is", max_new_tokens=4)
                assert out.details.generated_tokens >= 1 and isinstance(out.generated_text, str)
                return None
            raw = oai.completions.with_raw_response.create(model=model, prompt="The capital of France is",
                                                           max_tokens=4)
            assert raw.parse().choices[0].text, raw.http_response.text
            return raw.headers[REPLICA]

        with ThreadPoolExecutor(4) as pool:
            answered = [r for r in pool.map(ask, range(40)) if r is not None]
        assert len(answered) == 20
        replicas = set(answered)
        assert len(replicas) == 2, answered  # Ray's proxy spread the requests over both replicas

        # Each replica's own /metrics (reached through the proxy until both have answered) counts
        # what it served; together they served all 40 requests, TGI's included.
        served: dict[str, float] = {}
        for _ in range(60):
            r = httpx.get(server.url + "/metrics", timeout=30)
            assert r.status_code == 200, r.text
            served[r.headers[REPLICA]] = success_count(r.text)
            if set(served) == replicas:
                break
        assert set(served) == replicas, served
        assert all(count > 0 for count in served.values()) and sum(served.values()) == 40, served

        # Kill one replica's process between two requests: every request still succeeds (the
        # proxy routes around the dead replica), and Ray starts a replacement.
        pids = replica_pids(server.proc.pid)
        assert len(pids) == 2, pids
        os.kill(pids[0], signal.SIGKILL)
        replaced: set[str] = set()
        deadline = time.time() + 300
        i = 0
        while time.time() < deadline:
            ask(i)
            i += 1
            replaced = {replica_of_health(server.url) for _ in range(6)} - replicas
            if replaced:
                break
        assert replaced, f"Ray did not start a new replica in time:\n{server.log}"
        new = replaced.pop()
        with ThreadPoolExecutor(4) as pool:
            after = [r for r in pool.map(ask, range(20)) if r is not None]
        assert len(after) == 10
        assert set(after) <= replicas | {new}
        assert len(replica_pids(server.proc.pid)) == 2

        # SIGTERM: the command takes the application and its local Ray instance down.
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=120) == 0, server.log
        deadline = time.time() + 60
        while alive(started) and time.time() < deadline:
            time.sleep(1)
        assert not alive(started), f"processes left running after ray-serve stopped: {sorted(alive(started))}"
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(timeout=30)
        for pid in started | descendants(server.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_replica_that_cannot_load_its_model_stops_ray_serve_in_one_line(tmp_path):
    missing = tmp_path / "no-such-model"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    result = subprocess.run([str(ray_llmserve()), "ray-serve", str(missing), "--host", "127.0.0.1", "--port",
                             str(free_port()), "--log-level", "warning"], capture_output=True, text=True, env=env,
                            cwd=ROOT, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    # the replica's own error (the loader's message), not Ray's traceback
    assert last.startswith("error: the replicas did not start: ") and str(missing) in last, last
    assert "Traceback" not in last and "RayTaskError" not in last


@pytest.mark.parametrize("args, message", [
    (["a-model", "--model", "another"], "the model is given twice"),
    (["--min-replicas", "3", "--max-replicas", "2"], "--min-replicas (3) must be between 0 and --max-replicas (2)"),
    (["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"], "--ssl-keyfile is not used under Ray Serve"),
])
def test_bad_options_fail_in_one_line(args, message):
    result = subprocess.run([str(ray_llmserve()), "ray-serve", *args], capture_output=True, text=True, cwd=ROOT,
                            timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith("error: ") and message in result.stderr


def test_sigterm_while_replicas_wait_for_room_stops_everything():
    """No node has the CPUs a replica asks for, so the deployment waits: SIGTERM must still end
    the command at once and take its Ray instance down."""
    server = RayServe("--replica-cpus", "1000", "--log-level", "warning")
    started: set[int] = set()
    try:
        deadline = time.time() + 240
        while "LLMServeReplica" not in server.log:  # Ray's controller is deploying it
            assert server.proc.poll() is None and time.time() < deadline, server.log
            time.sleep(0.5)
        started = descendants(server.proc.pid)
        assert started and not server.serving.is_set()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=120) == 130, server.log
        deadline = time.time() + 60
        while alive(started) and time.time() < deadline:
            time.sleep(1)
        assert not alive(started), f"processes left running: {sorted(alive(started))}"
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(timeout=30)
        for pid in alive(started):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
