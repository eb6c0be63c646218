"""Soak benchmark: many requests across every dialect, a share of them abandoned mid-way.

Starts ``llmserve serve`` (the embedded SmolLM2 by default) in a subprocess, warms it up,
then sends ``--requests`` generation requests at ``--concurrency`` over all dialects' routes
(OpenAI chat and completions, TGI, vLLM-native, MindIE, Triton; streaming and not). A
``--disconnect-fraction`` of them is dropped by the client at a random point (before the
answer, or after the headers / first events). A ``--hostile-fraction`` of them are hostile
probes instead (``hostile_probes``: a megabyte stop string with n=4, megabyte and over-long
prompts, n of a million, lone surrogates, deep nesting, too many stop strings, a megabyte
/tokenize), each of which must get a 4xx. At the end it waits for the server to go idle
and reports: 5xx answers, other non-200 answers, leaked KV blocks (blocks still in use when
nothing runs), the server's RSS after warm-up and after the soak, and latency percentiles of
the completed requests. Not run in CI; results go to docs/benchmarks.md.

    python bench/soak.py                                  # 2,000 requests, concurrency 64
    python bench/soak.py --requests 500 --markdown docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from serve_bench import free_port, percentile  # bench/ is on sys.path when run as a script

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["Tell me about the sea.", "List three colours:", "The history of Rome began", "Write a haiku about autumn.",
           "def fibonacci(n):", "Once upon a time", "Explain photosynthesis briefly.", "My favourite food is"]


def routes(model: str, prompt: str, max_tokens: int) -> list[tuple[str, str, dict]]:
    """(name, path, body) for every generation route of every dialect."""
    chat = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    cmpl = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
    tgi = {"inputs": prompt, "parameters": {"max_new_tokens": max_tokens}}
    triton = {"text_input": prompt, "parameters": {"max_new_tokens": max_tokens}}
    return [("openai-chat", "/v1/chat/completions", chat),
            ("openai-chat-stream", "/v1/chat/completions", {**chat, "stream": True}),
            ("openai-completions", "/v1/completions", {**cmpl, "n": 2, "temperature": 0.8}),
            ("openai-completions-stream", "/v1/completions", {**cmpl, "stream": True}),
            ("tgi-generate", "/generate", tgi),
            ("tgi-generate-stream", "/generate_stream", tgi),
            ("vllm-generate", "/generate", {"prompt": prompt, "max_tokens": max_tokens}),
            ("vllm-generate-stream", "/generate", {"prompt": prompt, "max_tokens": max_tokens, "stream": True}),
            ("mindie-infer", "/infer", {"inputs": prompt, "parameters": {"max_new_tokens": max_tokens}}),
            ("mindie-infer-stream", "/infer", {"inputs": prompt, "stream": True,
                                               "parameters": {"max_new_tokens": max_tokens}}),
            ("triton-generate", f"/v2/models/{model}/generate", triton),
            ("triton-generate-stream", f"/v2/models/{model}/generate_stream", triton)]


def hostile_probes(model: str) -> list[tuple[str, str, dict | bytes]]:
    """(name, path, body) of requests that must be refused with a 4xx, fast, and leave nothing
    behind; a bytes body is sent as it is (JSON that ``json.dumps`` would not write)."""
    deep = ("[" * 20_000 + "]" * 20_000).encode()
    return [
        ("hostile-stop-1mb-n4", "/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 4, "n": 4,
                                                    "temperature": 1.0, "stop": ["ab" * 2**19]}),
        ("hostile-tgi-stop-1mb", "/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 4,
                                                                             "stop": ["ab" * 2**19]}}),
        ("hostile-prompt-2mb", "/v1/completions", {"model": model, "prompt": "word " * 400_000, "max_tokens": 4}),
        ("hostile-prompt-over-context", "/v1/completions", {"model": model, "prompt": "word " * 3000,
                                                            "max_tokens": 4}),
        ("hostile-n-million", "/v1/chat/completions", {"model": model, "n": 10**6,
                                                       "messages": [{"role": "user", "content": "Hi"}]}),
        ("hostile-surrogate", "/v1/completions",
         b'{"model": "' + model.encode() + b'", "prompt": "a\\ud800b", "max_tokens": 4}'),  # JSON escape \ud800
        ("hostile-deep-nesting", "/v1/completions", b'{"model": "' + model.encode() + b'", "prompt": ' + deep + b"}"),
        ("hostile-65-stops", "/generate", {"prompt": "Hi", "max_tokens": 4, "stop": [f"s{i}" for i in range(65)]}),
        ("hostile-tokenize-2mb", "/tokenize", {"model": model, "prompt": "word " * 400_000}),
    ]


def raw_request(path: str, body: dict | bytes) -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data


async def one(port: int, rng: random.Random, route: tuple[str, str, dict], drop: bool) -> dict:
    name, path, body = route
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw_request(path, body))
    await writer.drain()
    try:
        if drop:
            if rng.random() < 0.5:
                await asyncio.sleep(rng.uniform(0.0, 2.0))  # may still be queued or prefilling
            else:
                await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 600)
                await asyncio.sleep(rng.uniform(0.0, 1.0))  # somewhere mid-answer
            return {"route": name, "dropped": True}
        data = await asyncio.wait_for(reader.read(-1), 600)
        status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0
        return {"route": name, "dropped": False, "status": status, "latency": time.perf_counter() - start,
                "body": data[-300:] if status != 200 else b""}
    finally:
        writer.close()


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        m = re.match(r"^([a-z_:]+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m and m.group(1) in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            out[m.group(1)] = float(m.group(3))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--disconnect-fraction", type=float, default=0.25)
    ap.add_argument("--hostile-fraction", type=float, default=0.1,
                    help="share of requests that are hostile probes (each must get a 4xx)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2)")
    ap.add_argument("--server-arg", action="append", default=[], help="extra `llmserve serve` argument")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-pool-warmup", action="store_true",
                    help="skip filling the KV pool with unique prompts before the 'after warm-up' RSS")
    ap.add_argument("--markdown", default=None, help="append a result section to this file")
    args = ap.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    logs = ROOT / "bench" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / "soak-server.log"
    cmd = [sys.executable, "-m", "llmserve", "serve", "--port", str(port), "--dtype", "float32", "--device", "cpu",
           "--max-model-len", "1024", "--max-num-seqs", "32", "--log-level", "info", *args.server_arg]
    if args.model:
        cmd += ["--model", args.model]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            return run(args, proc, url, port, log_path)
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def run(args: argparse.Namespace, proc: subprocess.Popen, url: str, port: int, log_path: Path) -> int:
    end = time.time() + 600
    while True:
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > end:
            print(log_path.read_text()[-3000:])
            raise SystemExit("the server did not start")
        time.sleep(0.5)
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    blocks = int(re.search(r"KV cache: (\d+) blocks", log_path.read_text()).group(1))
    rng = random.Random(args.seed)
    plan = []
    probes = hostile_probes(model)
    for _ in range(args.requests):
        if rng.random() < args.hostile_fraction:
            plan.append((rng.choice(probes), False, random.Random(rng.random())))
            continue
        prompt = rng.choice(PROMPTS)
        plan.append((rng.choice(routes(model, prompt, rng.randint(4, args.max_tokens))),
                     rng.random() < args.disconnect_fraction, random.Random(rng.random())))

    server = psutil.Process(proc.pid)
    rss_marks: list[float] = []  # RSS (MiB) after each quarter of the soak's requests

    async def drive(items: list, marks: list | None = None) -> list[dict]:
        sem = asyncio.Semaphore(args.concurrency)
        done = [0]

        async def limited(route, drop, r):
            async with sem:
                out = await one(port, r, route, drop)
            done[0] += 1
            if marks is not None and done[0] % max(1, len(items) // 4) == 0:
                marks.append(round(server.memory_info().rss / 2**20, 1))
            return out

        return await asyncio.gather(*(limited(*item) for item in items))

    # Warm-up: every route, at full concurrency and undisturbed, so lazily built state and the
    # allocator's working set for the largest batches exist before the "before" RSS is read.
    warm_routes = routes(model, "Hello there, how are you today?", args.max_tokens)
    warm = asyncio.run(drive([(warm_routes[i % len(warm_routes)], False, random.Random(i))
                              for i in range(args.concurrency)]))
    assert all(r["status"] == 200 for r in warm), [r for r in warm if r["status"] != 200][:3]
    if not args.no_pool_warmup:
        # The KV pool's pages are committed by the OS on first write and the prefix cache walks
        # the whole pool before reusing a block, so RSS climbs until every block has been used
        # once. Unique prompts (no prefix-cache hits) fill the pool here, before "before".
        words = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()
        per_request = 12  # blocks of 16 tokens a ~200-token prompt takes
        warm_pool = []
        for i in range(blocks // per_request + 1):
            wr = random.Random(1_000_000 + i)
            text = f"{i}: " + " ".join(wr.choice(words) for _ in range(190))
            route = ("pool-warmup", "/v1/completions", {"model": model, "prompt": text, "max_tokens": 1})
            warm_pool.append((route, False, wr))
        t_pool = time.perf_counter()
        warmed = asyncio.run(drive(warm_pool))
        print(f"pool warm-up: {len(warm_pool)} unique prompts in {time.perf_counter() - t_pool:.0f} s", flush=True)
        assert all(r["status"] == 200 for r in warmed), [r for r in warmed if r["status"] != 200][:3]
    rss_before = server.memory_info().rss
    t0 = time.perf_counter()
    results = asyncio.run(drive(plan, rss_marks))
    wall = time.perf_counter() - t0
    end = time.time() + 120
    while True:  # idle: nothing running or waiting, every KV block back in the free pool
        m = metrics(url)
        if m.get("vllm:num_requests_running") == 0 and m.get("vllm:num_requests_waiting") == 0:
            break
        if time.time() > end:
            break
        time.sleep(0.5)
    leaked = round(m.get("vllm:kv_cache_usage_perc", 0.0) * blocks)
    rss_after = server.memory_info().rss
    done = [r for r in results if not r["dropped"]]
    hostile = [r for r in done if r["route"].startswith("hostile-")]
    done = [r for r in done if not r["route"].startswith("hostile-")]
    lat = [r["latency"] for r in done if r["status"] == 200]
    five = [r for r in done + hostile if r["status"] >= 500]
    other = [r for r in done if r["status"] != 200 and r["status"] < 500]
    other += [r for r in hostile if not 400 <= r["status"] < 500]  # a probe must be refused, never served
    alive = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2}).status_code
    summary = {
        "requests": args.requests, "concurrency": args.concurrency, "dropped": len(results) - len(done),
        "completed": len(done), "hostile": len(hostile), "hostile_4xx": sum(400 <= r["status"] < 500 for r in hostile),
        "hostile_p99_s": round(percentile([r["latency"] for r in hostile], 99), 2) if hostile else None,
        "http_5xx": len(five), "other_non_200": len(other),
        "still_running": m.get("vllm:num_requests_running"), "still_waiting": m.get("vllm:num_requests_waiting"),
        "leaked_blocks": leaked, "kv_blocks": blocks, "rss_before_mib": round(rss_before / 2**20, 1),
        "rss_after_mib": round(rss_after / 2**20, 1), "rss_by_quarter_mib": rss_marks, "wall_s": round(wall, 1),
        "latency_p50_s": round(percentile(lat, 50), 2), "latency_p99_s": round(percentile(lat, 99), 2),
        "after_soak_status": alive,
    }
    print(json.dumps(summary, indent=2))
    for r in (five + other)[:5]:
        print("example failure:", r["route"], r["status"], r["body"])
    if args.markdown:
        write_markdown(Path(args.markdown), args, summary)
    ok = not five and not other and leaked == 0 and alive == 200
    return 0 if ok else 1


def write_markdown(path: Path, args: argparse.Namespace, s: dict) -> None:
    cmd = "python bench/soak.py " + " ".join(a for a in sys.argv[1:])
    columns = {
        "requests": s["requests"], "concurrency": s["concurrency"], "dropped by client": s["dropped"],
        "completed": s["completed"], "hostile probes (4xx)": f"{s['hostile']} ({s['hostile_4xx']})",
        "hostile p99": f"{s['hostile_p99_s']} s", "5xx": s["http_5xx"], "other non-200": s["other_non_200"],
        f"leaked KV blocks (of {s['kv_blocks']})": s["leaked_blocks"],
        "RSS after warm-up": f"{s['rss_before_mib']} MiB",
        "RSS after each quarter": " / ".join(str(x) for x in s["rss_by_quarter_mib"]) + " MiB",
        "RSS after idle": f"{s['rss_after_mib']} MiB", "p50 latency": f"{s['latency_p50_s']} s",
        "p99 latency": f"{s['latency_p99_s']} s", "wall": f"{s['wall_s']} s",
    }
    table = "\n".join("| " + " | ".join(row) + " |" for row in (
        list(columns), ["---"] * len(columns), [str(v) for v in columns.values()]))
    text = f"""
### Soak {time.strftime('%Y-%m-%d')} — {platform.machine()}, {os.cpu_count()} cores, cpu, float32

Command: `{cmd.strip()}`

{table}
"""
    with open(path, "a") as f:
        f.write(text)


if __name__ == "__main__":
    raise SystemExit(main())
