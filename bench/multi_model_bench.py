"""Many models in one server: what loading on demand costs, and what it costs the others.

Starts one llmserve with the embedded SmolLM2 GGUF as the default model and a copy of it as a
second model loaded on demand (``--max-loaded-models 1``), then measures, ``--rounds`` times:

- **cold**: the first request naming the second model (load + prefill + 16 tokens), against
- **warm**: the same request once it is loaded;
- **ITL under a load**: a stream on the default model (256 tokens) while the second model
  loads, against the same stream with nothing loading (p50 / p99 / max inter-token gap);
- **memory**: the server's RSS with the default model only, with both, and after
  ``POST /models/unload`` of the second one.

    python bench/multi_model_bench.py                 # 3 rounds
    python bench/multi_model_bench.py --rounds 5 --markdown docs/benchmarks.md
"""

from __future__ import annotations

import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

import bench_args  # bench/bench_args.py: the script's folder is first on sys.path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def start(model: str, other: str, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "llmserve", "serve", "--model", model, "--served-model-name",
                             "base", "--model", f"other={other}", "--max-loaded-models", "1", "--port", str(port),
                             "--num-kv-blocks", "512", "--max-model-len", "2048", "--log-level", "warning"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not become ready")


def timed_request(url: str, model: str) -> float:
    started = time.perf_counter()
    reply = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "The history of computing",
                                                      "max_tokens": 16, "temperature": 0, "ignore_eos": True},
                       timeout=600)
    reply.raise_for_status()
    return time.perf_counter() - started


def stream_gaps(url: str, during: threading.Event | None = None) -> list[float]:
    """Inter-token gaps (s) of a 256-token stream on the default model; ``during`` is set once
    the stream has produced its first tokens (the moment to start a load)."""
    stamps: list[float] = []
    body = {"model": "base", "prompt": "Once upon a time", "max_tokens": 256, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
                if during is not None and len(stamps) == 8:
                    during.set()
    return [b - a for a, b in zip(stamps[8:], stamps[9:])]


def one_round(url: str, pid: int) -> dict:
    """One round of every measure (the second model unloaded at its start and its end)."""
    out: dict = {}
    base_rss = rss_mib(pid)
    out["cold"] = timed_request(url, "other")
    out["warm"] = timed_request(url, "other")
    both_rss = rss_mib(pid)
    httpx.post(url + "/models/unload", json={"model": "other"}, timeout=60).raise_for_status()
    time.sleep(0.5)
    out["mem"] = (base_rss, both_rss, rss_mib(pid))
    out["idle_gaps"] = stream_gaps(url)
    flag = threading.Event()
    reader = threading.Thread(target=lambda: out.setdefault("load_gaps", stream_gaps(url, flag)))
    reader.start()
    flag.wait(120)
    started = time.perf_counter()
    httpx.post(url + "/models/load", json={"model": "other"}, timeout=600).raise_for_status()
    out["load"] = time.perf_counter() - started
    reader.join()
    httpx.post(url + "/models/unload", json={"model": "other"}, timeout=60).raise_for_status()
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def main() -> None:
    parser = bench_args.new_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--markdown", help="append the table to this file")
    args = parser.parse_args()
    from llmserve.plugins.backends.torch.loader import embedded_model_path

    model = embedded_model_path()
    with tempfile.TemporaryDirectory() as folder:
        other = shutil.copy(model, Path(folder) / "other.gguf")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        t0 = time.perf_counter()
        proc = start(model, str(other), port)
        ready = time.perf_counter() - t0
        rounds: list[dict] = []
        try:
            timed_request(url, "base")  # warm the default model
            rounds = [one_round(url, proc.pid) for _ in range(args.rounds)]
        finally:
            proc.terminate()
            proc.wait(30)
    cold, warm, loads = ([r[k] for r in rounds] for k in ("cold", "warm", "load"))
    idle_gaps = [g for r in rounds for g in r["idle_gaps"]]
    load_gaps = [g for r in rounds for g in r["load_gaps"]]
    mem = [r["mem"] for r in rounds]
    ms = 1000.0
    rows = [
        ("time to ready (default model)", f"{ready:.1f} s"),
        ("first request to an unloaded model (load + 16 tokens), median", f"{statistics.median(cold):.2f} s"),
        ("same request, model loaded, median", f"{statistics.median(warm):.2f} s"),
        ("POST /models/load, median", f"{statistics.median(loads):.2f} s"),
        ("default model ITL, nothing loading: p50 / p99 / max",
         f"{pct(idle_gaps, .5) * ms:.1f} / {pct(idle_gaps, .99) * ms:.1f} / {max(idle_gaps) * ms:.1f} ms"),
        ("default model ITL, while the other loads: p50 / p99 / max",
         f"{pct(load_gaps, .5) * ms:.1f} / {pct(load_gaps, .99) * ms:.1f} / {max(load_gaps) * ms:.1f} ms"),
        ("RSS: default only / both loaded / after unload (median)",
         " / ".join(f"{statistics.median(m[i] for m in mem):.0f}" for i in range(3)) + " MiB"),
    ]
    table = ["| measure | value |", "|---|---|", *[f"| {a} | {b} |" for a, b in rows]]
    print("\n".join(table))
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write("\n" + "\n".join(table) + "\n")


if __name__ == "__main__":
    main()
