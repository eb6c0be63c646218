"""Side-by-side serving benchmark: llmserve vs `transformers serve --continuous-batching`.

Starts both servers on the same model and machine, then drives them in turn (never both at
once: the idle one waits on its socket) with the same closed-loop streaming workload
(POST /v1/completions, fixed prompts, max_tokens 128, greedy, every request running to
max_tokens: ignore_eos for llmserve, an unreachable EOS id in transformers serve's
generation_config) at each concurrency, and prints output tokens/s, TTFT p50/p99 and
inter-token latency p50/p99 with llmserve/peer ratios. Each level runs ``--rounds`` times per
server, alternating which server goes first, so that a slow spell of a shared machine hits
both alike; figures pool the rounds and the per-round ratios are printed too.
``--markdown FILE`` appends the table to FILE. Before the servers start, a plain transformers
``model.generate`` loop (greedy, one prompt at a time, 128 new tokens each) is timed on the same
model in a child process: the single-stream reference for concurrency 1
(``--skip-plain-generate`` leaves it out).

    python bench/serve_bench.py                       # embedded SmolLM2, fp32, c = 1 8 32
    python bench/serve_bench.py --concurrency 1 8 --requests-per-level 16 --skip-peer
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

import bench_args  # bench/bench_args.py: the script's folder is first on sys.path

# The load generator (client, closed loop, percentiles) and the prompts live in the package,
# shared with `llmserve bench serve`.
from llmserve.plugins.commands.bench.dataset import PROMPTS
from llmserve.plugins.commands.bench.loadgen import percentile, run_closed_loop


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def converted_model_dir(model: str | None, cache_dir: str | None) -> str:
    """The HF directory both servers load (for a GGUF: llmserve's converted cache)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from llmserve.plugins.backends.torch.loader import hf_directory

    return hf_directory(model, cache_dir)


def start(cmd: list[str], port: int, log_path: Path, env: dict[str, str],
          ready_path: str = "/ready") -> subprocess.Popen:
    """Start ``cmd`` and return once GET ``ready_path`` answers 200."""
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited early; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}{ready_path}", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)  # fine enough to time a start
    proc.kill()
    raise TimeoutError(f"{cmd} did not become ready")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


async def run_level(url: str, model: str, concurrency: int, total: int, max_tokens: int, extra: dict) -> dict:
    """One level: ``total`` streaming /v1/completions requests from ``concurrency`` workers;
    raises on the first refused request."""
    bodies = [{"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0.0,
               "stream": True, **extra} for i in range(total)]
    run = await run_closed_loop(url, "/v1/completions", bodies, concurrency, timeout=600)
    ttft = [s.ttft for s in run.samples]
    itl = [x for s in run.samples for x in s.itl]
    tokens = sum(s.output_tokens for s in run.samples)
    return summarize(concurrency, len(run.samples), tokens, run.wall_s, ttft, itl, run.client_cpu_s)


def summarize(concurrency: int, requests: int, tokens: int, wall: float, ttft: list[float], itl: list[float],
              client_cpu: float) -> dict:
    return {"concurrency": concurrency, "requests": requests, "tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall, "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99), "client_cpu_s": client_cpu,
            "ttft": ttft, "itl": itl}


def round_ratios(ours: dict, peer: dict) -> str:
    """The tokens per second of each round of ``ours`` over ``peer``'s (``pool_rounds`` rows),
    as the tables write them: ``1.02 / 0.98``."""
    return " / ".join(f"{a / b:.2f}" for a, b in zip(ours["rounds_tok_s"], peer["rounds_tok_s"]))


def pool_rounds(rows: list[dict]) -> dict:
    """One level's rounds as one run: tokens over total wall time, percentiles over all samples."""
    ttft = [x for r in rows for x in r["ttft"]]
    itl = [x for r in rows for x in r["itl"]]
    out = summarize(rows[0]["concurrency"], sum(r["requests"] for r in rows), sum(r["tokens"] for r in rows),
                    sum(r["wall_s"] for r in rows), ttft, itl, sum(r["client_cpu_s"] for r in rows))
    out["rounds_tok_s"] = [r["tok_s"] for r in rows]
    return out


def plain_generate(model_dir: str, dtype: str, device: str, max_tokens: int, runs: int = 3) -> dict:
    """Output tokens/s of transformers' own ``model.generate`` on the benchmark's prompts, one
    at a time (greedy, exactly ``max_tokens`` new tokens each, after one short warm-up call)."""
    import torch  # only the child process that measures this loads torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    tokens, wall = 0, 0.0
    with torch.inference_mode():
        for i in range(runs + 1):
            ids = tok(PROMPTS[i % len(PROMPTS)], return_tensors="pt").to(device)
            n = max_tokens if i else 4
            t0 = time.perf_counter()
            out = model.generate(**ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=tok.eos_token_id)
            if device == "cuda":
                torch.cuda.synchronize()
            if i:  # the first call is the warm-up
                wall += time.perf_counter() - t0
                tokens += out.shape[1] - ids["input_ids"].shape[1]
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall}


def plain_generate_in_child(model_dir: str, dtype: str, device: str, max_tokens: int) -> dict:
    """``plain_generate`` in a spawned process, so this client never loads torch and the
    model's memory is gone before the servers start."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(plain_generate, (model_dir, dtype, device, max_tokens))


class Server:
    """One server under test: started once, then driven level by level."""

    def __init__(self, name: str, cmd: list[str], port: int, model_name: str, extra: dict,
                 ready_path: str = "/ready") -> None:
        self.name, self.cmd, self.port, self.model_name, self.extra = name, cmd, port, model_name, extra
        self.ready_path = ready_path  # answers 200 once the model is loaded
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self, log_dir: str, env: dict[str, str]) -> None:
        print(f"starting {self.name}: {' '.join(self.cmd)}", flush=True)
        self.proc = start(self.cmd, self.port, Path(log_dir) / f"{self.name}.log", env, self.ready_path)
        asyncio.run(run_level(self.url, self.model_name, 1, 2, 8, self.extra))  # warm-up

    def level(self, concurrency: int, total: int, max_tokens: int) -> dict:
        row = asyncio.run(run_level(self.url, self.model_name, concurrency, total, max_tokens, self.extra))
        print(f"  {self.name} c={concurrency}: {row['tok_s']:.1f} tok/s, TTFT p50 {row['ttft_p50']*1000:.0f} ms, "
              f"ITL p50 {row['itl_p50']*1000:.1f} ms, client CPU {row['client_cpu_s']:.1f} s "
              f"over {row['wall_s']:.1f} s", flush=True)
        return row

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)

    def cpu_seconds(self) -> float:
        """CPU time the server process has used so far (Linux; NaN elsewhere)."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, AttributeError, ValueError, IndexError):
            return float("nan")


def run_all(servers: list[Server], args: argparse.Namespace, env: dict[str, str]) -> list[list[dict]]:
    """Per server, one pooled row per concurrency level."""
    try:
        for srv in servers:
            srv.start(args.log_dir, env)
        rounds: dict[str, dict[int, list[dict]]] = {srv.name: {c: [] for c in args.concurrency} for srv in servers}
        for c in args.concurrency:
            total = max(args.requests_per_level, c * 2) if args.requests_per_level else c * 2
            for r in range(args.rounds):
                order = servers if r % 2 == 0 else servers[::-1]
                for srv in order:
                    idle = [o for o in servers if o is not srv]
                    before = [o.cpu_seconds() for o in idle]
                    rounds[srv.name][c].append(srv.level(c, total, args.max_tokens))
                    for o, b in zip(idle, before):  # the idle server must not compete for the cores
                        print(f"    (idle {o.name} meanwhile used {o.cpu_seconds() - b:.1f} s of CPU)", flush=True)
        return [[pool_rounds(rounds[srv.name][c]) for c in args.concurrency] for srv in servers]
    finally:
        for srv in servers:
            srv.stop()


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
            lines.append(f"| {row['concurrency']} | **ratio llmserve/peer** (rounds: {round_ratios(row, p)}) | "
                         f"**{row['tok_s']/p['tok_s']:.2f}x** | "
                         f"{row['ttft_p50']/p['ttft_p50']:.2f} | {row['ttft_p99']/p['ttft_p99']:.2f} | "
                         f"{row['itl_p50']/p['itl_p50']:.2f} | {row['itl_p99']/p['itl_p99']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = bench_args.new_parser(__doc__)
    bench_args.add_model(ap)
    bench_args.add_levels(ap)
    ap.add_argument("--skip-peer", action="store_true", help="only benchmark llmserve")
    ap.add_argument("--skip-plain-generate", action="store_true",
                    help="do not time the plain model.generate loop (the concurrency-1 reference)")
    ap.add_argument("--peer-eos-id", type=int, default=None,
                    help="EOS id given to transformers serve so it runs to max_tokens (default: the vocab's last id)")
    ap.add_argument("--llmserve-args", default="", help="extra flags for llmserve serve")
    bench_args.add_outputs(ap, "append the result table to this file")
    args = ap.parse_args()
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    model_dir = converted_model_dir(args.model, None)
    port = free_port()
    ours_cmd = [sys.executable, "-m", "llmserve", "serve", model_dir, "--port", str(port), "--dtype", args.dtype,
                "--device", args.device, "--served-model-name", "bench", "--log-level", "warning",
                *args.llmserve_args.split()]
    # ignore_eos keeps every request at max_tokens (transformers serve: see below).
    servers = [Server("llmserve", ours_cmd, port, "bench",
                      {"ignore_eos": True, "stream_options": {"include_usage": True}})]
    if not args.skip_peer:
        exe = shutil.which("transformers") or str(Path(sys.executable).parent / "transformers")
        peer_port = free_port()
        peer_cmd = [exe, "serve", "--continuous-batching", model_dir, "--port", str(peer_port), "--host",
                    "127.0.0.1", "--dtype", args.dtype, "--device", args.device]
        # transformers serve has no ignore_eos, and its continuous batching ignores
        # min_new_tokens; a generation_config whose EOS is an id greedy decoding never picks
        # here (the vocabulary's last) gives it the same 128-token requests, and it reports
        # them in usage. A request that still stopped early would show in the token count.
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        gen = {"eos_token_id": [args.peer_eos_id if args.peer_eos_id is not None else vocab - 1],
               "max_new_tokens": args.max_tokens, "do_sample": False}
        servers.append(Server("transformers", peer_cmd, peer_port, model_dir, {"generation_config": json.dumps(gen)},
                              "/v1/models"))  # transformers serve has no readiness route
    plain = None
    if not args.skip_plain_generate:
        os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # inherited by the child
        plain = plain_generate_in_child(model_dir, args.dtype, args.device, args.max_tokens)
        print(f"plain model.generate: {plain['tok_s']:.1f} tok/s ({plain['tokens']} tokens)", flush=True)
    results = run_all(servers, args, env)
    ours, peer = results[0], (results[1] if len(results) > 1 else None)
    md = table(ours, peer)
    if plain is not None:
        single = next((r for r in ours if r["concurrency"] == 1), None)
        md += (f"\n\nPlain `model.generate` loop (greedy, one request at a time): {plain['tok_s']:.1f} tok/s"
               + (f"; llmserve at concurrency 1: {single['tok_s']:.1f} tok/s "
                  f"(**{single['tok_s'] / plain['tok_s']:.2f}x**)" if single else ""))
    print(md)
    header = (f"\n### {time.strftime('%Y-%m-%d')} — {platform.machine()}, {os.cpu_count()} cores, "
              f"{args.device}, {args.dtype}, max_tokens {args.max_tokens}\n\n"
              f"Command: `python bench/serve_bench.py {' '.join(sys.argv[1:])}`\n\n")
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(header + md + "\n")
    if args.json:
        def slim(rows: list[dict] | None) -> list[dict] | None:  # raw samples stay out of the file
            return None if rows is None else [{k: v for k, v in r.items() if k not in ("ttft", "itl")} for r in rows]

        Path(args.json).write_text(json.dumps({"llmserve": slim(ours), "peer": slim(peer), "plain_generate": plain},
                                              indent=2))


if __name__ == "__main__":
    main()
