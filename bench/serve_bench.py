"""Side-by-side serving benchmark: llmserve vs `transformers serve --continuous-batching`.

Starts each server in turn on the same model and machine (one at a time, so they never share
the CPU), drives it with the same closed-loop streaming workload (POST /v1/completions,
fixed prompts, max_tokens 128, greedy, every request running to max_tokens: ignore_eos for
llmserve, an unreachable EOS id in transformers serve's generation_config) at each concurrency, and
prints output tokens/s, TTFT p50/p99 and inter-token latency p50/p99 with llmserve/peer
ratios. `--markdown FILE` appends the table to FILE.

    python bench/serve_bench.py                       # embedded SmolLM2, fp32, c = 1 8 32
    python bench/serve_bench.py --concurrency 1 8 --requests-per-level 16 --skip-peer
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import resource
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "List some tips for learning a new programming language quickly and effectively.",
    "What are the main differences between classical and operant conditioning?",
    "Describe the water cycle in detail, including evaporation, condensation and precipitation.",
    "Give me a recipe for a simple vegetable soup.",
    "Why is the sky blue? Answer in a few paragraphs.",
    "Summarize the plot of a heist movie you invent on the spot.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


def converted_model_dir(model: str | None, cache_dir: str | None) -> str:
    """The HF directory both servers load (for a GGUF: llmserve's converted cache)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from llmserve.plugins.backends.torch.loader import hf_directory  # noqa: PLC0415

    return hf_directory(model, cache_dir)


def start(cmd: list[str], port: int, log_path: Path, env: dict[str, str]) -> subprocess.Popen:
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited early; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"{cmd} did not become ready")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


# The client shares the machine's cores with the server under test, so it parses as little as
# it can: JSON only for the chunk that carries usage; otherwise a pattern says whether a chunk
# has text (a non-empty "text" value). Its CPU time per level is reported with the results.
_HAS_TEXT = re.compile(r'"text":\s*"[^"]')
_HAS_USAGE = re.compile(r'"usage":\s*\{')


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                      extra: dict) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True, **extra}
    t0 = time.perf_counter()
    stamps: list[float] = []
    usage_tokens = None
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if _HAS_TEXT.search(line):
                stamps.append(time.perf_counter())
            if _HAS_USAGE.search(line):
                usage_tokens = (json.loads(line[6:]).get("usage") or {}).get("completion_tokens")
    end = time.perf_counter()
    tokens = usage_tokens or len(stamps)
    itl = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"ttft": (stamps[0] - t0) if stamps else float("nan"), "itl": itl, "tokens": tokens,
            "latency": end - t0}


async def run_level(url: str, model: str, concurrency: int, total: int, max_tokens: int, extra: dict) -> dict:
    results: list[dict] = []
    queue = list(range(total))
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def worker() -> None:
            while queue:
                i = queue.pop()
                results.append(await one_request(client, url, model, PROMPTS[i % len(PROMPTS)], max_tokens, extra))

        t0, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall, cpu1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    ttft = [r["ttft"] for r in results]
    itl = [x for r in results for x in r["itl"]]
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": len(results), "tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall, "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99),
            "client_cpu_s": (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)}


def bench_server(name: str, cmd: list[str], port: int, model_name: str, args: argparse.Namespace,
                 env: dict[str, str], extra: dict) -> list[dict]:
    log_path = Path(args.log_dir) / f"{name}.log"
    print(f"starting {name}: {' '.join(cmd)}", flush=True)
    proc = start(cmd, port, log_path, env)
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(run_level(url, model_name, 1, 2, 8, extra))  # warm-up
        rows = []
        for c in args.concurrency:
            total = max(args.requests_per_level, c * 2) if args.requests_per_level else c * 2
            row = asyncio.run(run_level(url, model_name, c, total, args.max_tokens, extra))
            print(f"  {name} c={c}: {row['tok_s']:.1f} tok/s, TTFT p50 {row['ttft_p50']*1000:.0f} ms, "
                  f"ITL p50 {row['itl_p50']*1000:.1f} ms, client CPU {row['client_cpu_s']:.1f} s "
                  f"over {row['wall_s']:.1f} s", flush=True)
            rows.append(row)
        return rows
    finally:
        stop(proc)


def table(ours: list[dict], peer: list[dict] | None) -> str:
    lines = ["| c | server | out tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |",
             "|---|---|---|---|---|---|---|"]
    for i, row in enumerate(ours):
        pairs = [("llmserve", row)] + ([("transformers serve", peer[i])] if peer else [])
        for name, r in pairs:
            lines.append(f"| {r['concurrency']} | {name} | {r['tok_s']:.1f} | {r['ttft_p50']*1000:.0f} | "
                         f"{r['ttft_p99']*1000:.0f} | {r['itl_p50']*1000:.1f} | {r['itl_p99']*1000:.1f} |")
        if peer:
            p = peer[i]
            lines.append(f"| {row['concurrency']} | **ratio llmserve/peer** | **{row['tok_s']/p['tok_s']:.2f}x** | "
                         f"{row['ttft_p50']/p['ttft_p50']:.2f} | {row['ttft_p99']/p['ttft_p99']:.2f} | "
                         f"{row['itl_p50']/p['itl_p50']:.2f} | {row['itl_p99']/p['itl_p99']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF dir or .gguf (default: the embedded SmolLM2)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests-per-level", type=int, default=0, help="default: 2 x concurrency")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--skip-peer", action="store_true", help="only benchmark llmserve")
    ap.add_argument("--peer-eos-id", type=int, default=None,
                    help="EOS id given to transformers serve so it runs to max_tokens (default: the vocab's last id)")
    ap.add_argument("--llmserve-args", default="", help="extra flags for llmserve serve")
    ap.add_argument("--log-dir", default="bench/logs")
    ap.add_argument("--markdown", default=None, help="append the result table to this file")
    ap.add_argument("--json", default=None, help="write raw results as JSON")
    args = ap.parse_args()
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    model_dir = converted_model_dir(args.model, None)
    port = free_port()
    ours_cmd = [sys.executable, "-m", "llmserve", "serve", model_dir, "--port", str(port), "--dtype", args.dtype,
                "--device", args.device, "--served-model-name", "bench", "--log-level", "warning",
                *args.llmserve_args.split()]
    # ignore_eos keeps every request at max_tokens (transformers serve: see below).
    ours = bench_server("llmserve", ours_cmd, port, "bench", args, env,
                        {"ignore_eos": True, "stream_options": {"include_usage": True}})
    peer = None
    if not args.skip_peer:
        exe = shutil.which("transformers") or str(Path(sys.executable).parent / "transformers")
        port = free_port()
        peer_cmd = [exe, "serve", "--continuous-batching", model_dir, "--port", str(port), "--host", "127.0.0.1",
                    "--dtype", args.dtype, "--device", args.device]
        # transformers serve has no ignore_eos, and its continuous batching ignores
        # min_new_tokens; a generation_config whose EOS is an id greedy decoding never picks
        # here (the vocabulary's last) gives it the same 128-token requests, and it reports
        # them in usage. A request that still stopped early would show in the token count.
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        gen = {"eos_token_id": [args.peer_eos_id if args.peer_eos_id is not None else vocab - 1],
               "max_new_tokens": args.max_tokens, "do_sample": False}
        peer = bench_server("transformers", peer_cmd, port, model_dir, args, env,
                            {"generation_config": json.dumps(gen)})
    md = table(ours, peer)
    print(md)
    header = (f"\n### {time.strftime('%Y-%m-%d')} — {platform.machine()}, {os.cpu_count()} cores, "
              f"{args.device}, {args.dtype}, max_tokens {args.max_tokens}\n\n"
              f"Command: `python bench/serve_bench.py {' '.join(sys.argv[1:])}`\n\n")
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(header + md + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"llmserve": ours, "peer": peer}, indent=2))


if __name__ == "__main__":
    main()
