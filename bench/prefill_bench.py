"""Long-prompt benchmark: prefill speed and decode at length, llmserve vs llama-server on the same GGUF.

For each model and each prompt length N, one streamed ``/v1/completions`` request whose prompt is
N random token ids (a fresh prompt every time: no prefix is reused) and ``--decode-tokens``
output tokens (greedy, ``ignore_eos``): the time to the first token is the prefill (prefill
tok/s = N / TTFT) and the median gap between the following tokens is one decode step at that
context. Servers, one after the other on the same file: llmserve (``llmserve serve FILE
--max-model-len ...``), then llama-server with flash attention on and with it off (``-fa on`` /
``-fa off``), each with one slot as long as the longest prompt. The resident memory of each
server after its longest prompt is reported beside, and the arithmetic limit: the prompt's
floating-point work (projections: 2 x parameters per token; attention: 4 x heads x head size per
query-key pair) over the machine's measured fp32 matmul rate (quantized products can beat it).
Then an agent replay (``--agent-turns``): a long first prompt, each later turn the whole previous
prompt plus a few hundred new tokens; its TTFTs show whether a server prefills only the new ones.

    python bench/make_models.py && python bench/prefill_bench.py --markdown docs/benchmarks.md
    python bench/prefill_bench.py --prompt-tokens 1024 4096 --quants Q4_K_M
    python bench/prefill_bench.py --llmserve-args "--kv-cache-dtype int8" --peer-args "-ctk q8_0 -ctv q8_0" \
        --peer-flash-attention on    # llama.cpp quantizes its V cache only with flash attention
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import bench_args  # bench/bench_args.py: the script's folder is first on sys.path
import llama_cpp
import make_models
from gguf_bench import MeasuredServer, rss_bytes
from serve_bench import free_port

from llmserve.plugins.commands.bench.loadgen import percentile, run_closed_loop

# Token ids of ordinary vocabulary entries in every model this script builds (SmolLM2's
# vocabulary: its special tokens sit below 20).
FIRST_ID, LAST_ID = 100, 49000


def prompt_ids(n: int, rng: random.Random, last: int = LAST_ID) -> list[int]:
    return [rng.randrange(FIRST_ID, last) for _ in range(n)]


def last_id(path: Path) -> int:
    """The top of the id range prompts draw from: LAST_ID, or below it for a smaller vocabulary
    (the Gemma 4 set's 32768 tokens)."""
    from gguf import GGUFReader

    tokens = GGUFReader(str(path)).fields.get("tokenizer.ggml.tokens")
    return min(LAST_ID, len(tokens.data) - 1) if tokens is not None else LAST_ID


# One request's limit: a 32768-token prompt takes llama-server over an hour on 2 cores.
REQUEST_TIMEOUT = 4 * 3600


async def one_request(url: str, model: str, ids: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    run = await run_closed_loop(url, "/v1/completions", [body], 1, timeout=REQUEST_TIMEOUT)
    sample = run.samples[0]
    return {"ttft": sample.ttft, "itl_p50": percentile(sample.itl, 50) if sample.itl else float("nan"),
            "output_tokens": sample.output_tokens}


def flop_rate(seconds: float = 1.0) -> float:
    """fp32 multiply-adds per second of this machine on all cores (a large torch matmul), x2."""
    import torch

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    torch.mm(a, b)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.mm(a, b)
        n += 1
    return 2 * 2048**3 * n / (time.perf_counter() - t0)


def prompt_flops(source: Path, n: int) -> float:
    """Floating-point work of prefilling n tokens: projections and attention (causal)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(source))

    def value(suffix: str) -> int:
        for key, field in reader.fields.items():
            if key.endswith(suffix):
                return int(field.parts[field.data[0]][0])
        raise KeyError(suffix)

    layers, heads = value(".block_count"), value(".attention.head_count")
    head_dim = value(".embedding_length") // heads
    params = sum(int(t.n_elements) for t in reader.tensors if t.name.startswith("blk."))
    return 2 * params * n + layers * 4 * heads * head_dim * n * (n + 1) / 2


def servers_for(src: Path, args: argparse.Namespace, server_exe: Path | None) -> list[MeasuredServer]:
    replay = args.agent_prefix + args.agent_step * (args.agent_turns - 1) if args.agent_turns else 0
    ctx = max(*args.prompt_tokens, replay) + args.decode_tokens + 16
    servers = []
    if not args.skip_llmserve:
        port = free_port()
        cmd = [sys.executable, "-m", "llmserve", "serve", str(src), "--port", str(port), "--device", "cpu",
               "--served-model-name", "bench", "--log-level", "warning", "--max-model-len", str(ctx),
               *args.llmserve_args.split()]
        servers.append(MeasuredServer("llmserve", cmd, port, {}, "/ready"))
    if server_exe is not None:
        for fa in args.peer_flash_attention:
            port = free_port()
            cmd = [str(server_exe), "-m", str(src), "--host", "127.0.0.1", "--port", str(port), "-np", "1",
                   "-t", str(args.threads), "-c", str(ctx), "-fa", fa, *args.peer_args.split()]
            servers.append(MeasuredServer(f"llama-server -fa {fa}", cmd, port, {}, "/health"))
    return servers


def agent_replay(srv: MeasuredServer, args: argparse.Namespace, rng: random.Random) -> list[float]:
    """An agent session's shape: turn 1 a long fixed prefix (system prompt and tools), each later
    turn the whole previous prompt plus ``--agent-step`` new tokens (the model's reply and the
    next message). Returns each turn's TTFT: turns 2+ should prefill only their new tokens."""
    prompt = prompt_ids(args.agent_prefix, rng, args.last_id)
    ttfts = []
    for turn in range(args.agent_turns):
        if turn:
            prompt = prompt + prompt_ids(args.agent_step, rng, args.last_id)
        ttfts.append(asyncio.run(one_request(srv.url, srv.model_name, prompt, 1))["ttft"])
    print(f"  {srv.name} agent replay TTFT per turn: " + ", ".join(f"{t:.2f} s" for t in ttfts), flush=True)
    return ttfts


def run_server(srv: MeasuredServer, lengths: list[int], args: argparse.Namespace, env: dict) -> dict:
    srv.start(args.log_dir, env)
    rng = random.Random(args.seed)
    rows, replay = [], []
    try:
        for n in lengths:
            row = asyncio.run(one_request(srv.url, srv.model_name, prompt_ids(n, rng, args.last_id),
                                          args.decode_tokens))
            row.update(n=n, prefill_tok_s=n / row["ttft"], rss=rss_bytes(srv.proc.pid))
            print(f"  {srv.name} {n} tokens: TTFT {row['ttft']:.2f} s ({row['prefill_tok_s']:.1f} tok/s), "
                  f"decode step {row['itl_p50'] * 1000:.1f} ms, RSS {row['rss'] / 2**20:.0f} MiB", flush=True)
            rows.append(row)
        if args.agent_turns:
            replay = agent_replay(srv, args, rng)
    finally:
        srv.stop()
    return {"rows": rows, "replay": replay}


def replay_table(servers: list[MeasuredServer], replays: list[list[float]], args: argparse.Namespace) -> str:
    turns = len(replays[0])
    lines = [f"Agent replay: a {args.agent_prefix}-token prefix, then {args.agent_step} new tokens a turn; "
             "TTFT in seconds per turn (later turns over turn 1 in brackets)", "",
             "| server | " + " | ".join(f"turn {t + 1}" for t in range(turns)) + " |",
             "|---|" + "---|" * turns]
    for srv, ttfts in zip(servers, replays):
        lines.append(f"| {srv.name} | {ttfts[0]:.2f} | "
                     + " | ".join(f"{t:.2f} ({t / ttfts[0]:.0%})" for t in ttfts[1:]) + " |")
    return "\n".join(lines)


def table(label: str, servers: list[MeasuredServer], results: list[list[dict]], src: Path, rate: float) -> str:
    lines = [f"**{label}**", "",
             "| prompt tokens | server | TTFT s | prefill tok/s (share of arithmetic limit) | decode ms/token "
             "| RSS MiB | ours/this prefill | ours/this decode |",
             "|---|---|---|---|---|---|---|---|"]
    for i, n in enumerate(r["n"] for r in results[0]):
        limit = n / (prompt_flops(src, n) / rate)
        ours = results[0][i] if servers[0].name == "llmserve" else None
        for srv, rows in zip(servers, results):
            r = rows[i]
            vs = ("", "") if ours is None or r is ours else (
                f"{ours['prefill_tok_s'] / r['prefill_tok_s']:.2f}x", f"{r['itl_p50'] / ours['itl_p50']:.2f}x")
            lines.append(f"| {n} | {srv.name} | {r['ttft']:.2f} | {r['prefill_tok_s']:.1f} "
                         f"({r['prefill_tok_s'] / limit:.0%} of {limit:.0f}) | {r['itl_p50'] * 1000:.1f} | "
                         f"{r['rss'] / 2**20:.0f} | {vs[0]} | {vs[1]} |")
    return "\n".join(lines)


def main() -> None:
    ap = bench_args.new_parser(__doc__)
    ap.add_argument("--models", nargs="+", default=None, help="GGUF files (default: bench/make_models.py's)")
    ap.add_argument("--models-dir", default=str(make_models.DEFAULT_DIR))
    ap.add_argument("--quants", nargs="+", default=["Q4_K_M", "Q8_0"], choices=["Q8_0", "Q4_K_M", "Q4_0"])
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--decode-tokens", type=int, default=16, help="output tokens after each prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--agent-turns", type=int, default=3, help="turns of the agent replay (0: none)")
    ap.add_argument("--agent-prefix", type=int, default=4096, help="tokens of the replay's first turn")
    ap.add_argument("--agent-step", type=int, default=256, help="new tokens each later turn adds")
    ap.add_argument("--skip-llmserve", action="store_true")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--peer-flash-attention", nargs="+", default=["on", "off"], choices=["on", "off"])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server -t")
    ap.add_argument("--llama-cpp", default=None, help="folder holding llama-server (default: PATH, else built)")
    ap.add_argument("--llmserve-args", default="", help="extra flags for llmserve serve")
    ap.add_argument("--peer-args", default="", help="extra flags for llama-server")
    bench_args.add_outputs(ap, "append the result tables to this file")
    args = ap.parse_args()
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    models = ([Path(m) for m in args.models] if args.models else
              [make_models.gguf_path(Path(args.models_dir).expanduser(), "llama-1b-shape", q) for q in args.quants])
    if missing := [str(m) for m in models if not m.exists()]:
        sys.exit("missing model files (run bench/make_models.py): " + ", ".join(missing))
    server_exe = None if args.skip_peer else llama_cpp.ensure(args.llama_cpp).server
    rate = flop_rate()
    print(f"fp32 matmul rate: {rate / 1e9:.0f} GFLOP/s", flush=True)
    lengths = sorted(args.prompt_tokens)
    tables, raw = [], []
    for src in models:
        print(f"== {src.name}", flush=True)
        args.last_id = last_id(src)
        servers = servers_for(src, args, server_exe)
        runs = [run_server(srv, lengths, args, env) for srv in servers]
        results = [run["rows"] for run in runs]
        tables.append(table(src.name, servers, results, src, rate))
        if args.agent_turns:
            tables.append(replay_table(servers, [run["replay"] for run in runs], args))
        print("\n\n".join(tables[-2:] if args.agent_turns else tables[-1:]), flush=True)
        raw.append({"model": src.name, "servers": [{"name": s.name, "cmd": s.cmd, "ready_s": s.ready_s, **run}
                                                   for s, run in zip(servers, runs)]})
    header = (f"\n### {time.strftime('%Y-%m-%d')} — long prompts: llmserve vs llama-server, {platform.machine()}, "
              f"{os.cpu_count()} cores, fp32 matmul {rate / 1e9:.0f} GFLOP/s\n\n"
              f"Command: `python bench/prefill_bench.py {' '.join(sys.argv[1:])}`\n\n")
    md = header + "\n\n".join(tables)
    print(md)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(md + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"flop_rate": rate, "models": raw}, indent=2))


if __name__ == "__main__":
    main()
