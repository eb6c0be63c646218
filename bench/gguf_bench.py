"""GGUF benchmark: llmserve vs llama.cpp's ``llama-server`` on the same GGUF file.

For each model, both servers are started on the same file (llmserve: ``llmserve serve FILE``;
llama-server: ``-m FILE -np <max concurrency> -t <cores>`` with a context of enough tokens for
every slot), one after the other, each timed from process start until its readiness route
answers 200 (llmserve ``/ready``, llama-server ``/health``), and measured for resident memory
right after (psutil, children included). Then both are driven, in turn, with serve_bench's
closed-loop streaming workload (POST /v1/completions, same prompts, fixed max_tokens, greedy,
``ignore_eos``): levels interleaved, rounds alternating which server goes first. The table gives
output tok/s, TTFT p50, ITL p50, RSS and time to ready with llmserve/llama-server ratios, and
beside each concurrency-1 figure the physical limit: the machine's memory read bandwidth
(measured here over a 2 GiB buffer, well past any L3 cache) over the bytes one decode step
reads (the weights of the file plus the KV cache). By default the 1B-shaped models of
bench/make_models.py are run (Q8_0, Q4_K_M, Q4_0), plus a bf16 line: llmserve on the bf16
safetensors directory vs llama-server on the BF16 GGUF of the same weights (``--quants``
picks among them); ``--family qwen3`` runs make_models.py's Qwen3-shaped set instead.

    python bench/make_models.py && python bench/gguf_bench.py --markdown docs/benchmarks.md
    python bench/gguf_bench.py --small --concurrency 1 8 --requests-per-level 8 --max-tokens 32
    python bench/make_models.py --family qwen3 && python bench/gguf_bench.py --family qwen3 --quants Q4_K_M Q8_0
    python bench/gguf_bench.py --models my-Q4_K_M.gguf --skip-llmserve --llama-cpp ~/llama.cpp/build

``--busy N`` keeps N processes spinning on the CPU (a Python ``while True: pass`` each) from
before the servers start until the last level ends, for both servers alike: decode under
contention, when another program takes some of the cores the servers' threads were sized for.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import bench_args  # bench/bench_args.py: the script's folder is first on sys.path
import llama_cpp
import make_models
import psutil
from serve_bench import Server, free_port, round_ratios, run_all, run_level, start

# Decode steps of the workload see, on average, the prompt plus half the output in the KV
# cache. The prompts are 10-16 tokens; 32 bounds them (and sizes llama-server's slots), and
# the KV term is small beside the weights at these lengths.
PROMPT_TOKENS = 32
KV_BYTES = 2  # f16/bf16 cache entries


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and all its children."""
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:  # a child that just exited
            pass
    return total


class MeasuredServer(Server):
    """A serve_bench server that also records time to ready and resident memory."""

    def __init__(self, name: str, cmd: list[str], port: int, extra: dict, ready_path: str) -> None:
        super().__init__(name, cmd, port, "bench", extra, ready_path)
        self.ready_s = math.nan
        self.rss_ready = self.rss_end = 0

    def start(self, log_dir: str, env: dict[str, str]) -> None:
        print(f"starting {self.name}: {' '.join(self.cmd)}", flush=True)
        t0 = time.perf_counter()
        self.proc = start(self.cmd, self.port, Path(log_dir) / f"{self.name}.log", env, self.ready_path)
        self.ready_s = time.perf_counter() - t0
        self.rss_ready = rss_bytes(self.proc.pid)
        print(f"  {self.name} ready in {self.ready_s:.1f} s, RSS {self.rss_ready / 2**20:.0f} MiB", flush=True)
        asyncio.run(run_level(self.url, self.model_name, 1, 2, 8, self.extra))  # warm-up

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.rss_end = rss_bytes(self.proc.pid)
        super().stop()


def _read_bandwidth(gib: float, repeats: int) -> float:
    import torch  # only the child process that measures this loads torch

    buf = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum().item()
        best = max(best, buf.numel() * 4 / (time.perf_counter() - t0))
    return best


def memory_bandwidth(gib: float = 2.0, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: the best of ``repeats`` sums over a ``gib`` GiB buffer, on all
    cores, in a spawned process (so this client never holds torch or the buffer)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_read_bandwidth, (gib, repeats))


def kv_bytes_per_position(source: Path) -> int:
    """K and V bytes one cached position takes, from config.json (the engine's own cache layout:
    layers of their own head counts and sizes, layers that keep none) or the GGUF metadata (head
    counts once or per layer, Gemma's sliding layers' own head size, shared layers keeping none)."""
    if source.is_dir():
        raw = json.loads((source / "config.json").read_text())
        if "model_type" not in raw:  # a bare config: one shape for every layer
            head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
            return 2 * raw["num_hidden_layers"] * raw["num_key_value_heads"] * head_dim * KV_BYTES
        from transformers import AutoConfig

        from llmserve.plugins.backends.torch.kv_layout import kv_layout

        cfg = AutoConfig.from_pretrained(source)
        return sum(2 * h * d for h, d in kv_layout(cfg.get_text_config()).shapes) * KV_BYTES
    from gguf import GGUFReader

    fields = GGUFReader(str(source)).fields

    def values(suffix: str) -> list[int] | None:
        for key, field in fields.items():
            if key.endswith(suffix):
                return [int(field.parts[i][0]) for i in field.data]
        return None

    layers = (values(".block_count") or [0])[0]
    kv = values(".attention.head_count_kv") or [0]
    kv = kv * layers if len(kv) == 1 else kv
    full = (values(".attention.key_length") or [0])[0] or (
        (values(".embedding_length") or [0])[0] // (values(".attention.head_count") or [1])[0])
    swa_dim = (values(".attention.key_length_swa") or [full])[0]
    pattern = values(".attention.sliding_window_pattern")
    dims = [swa_dim if pattern and pattern[i] else full for i in range(layers)]
    own = layers - (values(".attention.shared_kv_layers") or [0])[0]
    return sum(2 * kv[i] * dims[i] for i in range(own)) * KV_BYTES


def weight_bytes(source: Path) -> int:
    """Bytes of weights a decode step reads: the GGUF file, or a directory's safetensors."""
    if source.is_dir():
        return sum(p.stat().st_size for p in source.glob("*.safetensors"))
    return source.stat().st_size


def limit_tok_s(bandwidth: float, source: Path, max_tokens: int) -> float:
    """Single-stream ceiling: bandwidth over the bytes one decode step must read."""
    per_token = weight_bytes(source) + kv_bytes_per_position(source) * (PROMPT_TOKENS + max_tokens // 2)
    return bandwidth / per_token


def model_set(args: argparse.Namespace) -> list[tuple[str, Path, Path]]:
    """(label, what llmserve loads, what llama-server loads) for each line of the table."""
    if args.models:
        return [(Path(m).name, Path(m), Path(m)) for m in args.models]
    name = make_models.model_name(args.family, args.small)
    models_dir = Path(args.models_dir).expanduser()
    lines = []
    for q in args.quants:
        gguf = make_models.gguf_path(models_dir, name, "BF16" if q == "bf16" else q)
        # The bf16 line: llmserve loads the safetensors directory the GGUF files were made from.
        lines.append((f"{name} bf16 (llmserve: safetensors)", models_dir / name, gguf) if q == "bf16"
                     else (f"{name} {q}", gguf, gguf))
    missing = [str(p) for _, a, b in lines for p in (a, b) if not p.exists()]
    if missing:
        flags = (" --small" if args.small else "") + (f" --family {args.family}" if args.family != "llama" else "")
        sys.exit(f"missing model files (run bench/make_models.py{flags}): " + ", ".join(missing))
    return lines


@contextlib.contextmanager
def busy_processes(n: int) -> Iterator[None]:
    """``n`` processes each spinning one core for as long as the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def servers_for(ours_src: Path, peer_src: Path, args: argparse.Namespace, server_exe: Path | None) -> list:
    extra = {"ignore_eos": True, "stream_options": {"include_usage": True}}
    servers = []
    if not args.skip_llmserve:
        port = free_port()
        cmd = [sys.executable, "-m", "llmserve", "serve", str(ours_src), "--port", str(port), "--device", "cpu",
               "--served-model-name", "bench", "--log-level", "warning", *args.llmserve_args.split()]
        servers.append(MeasuredServer("llmserve", cmd, port, extra, "/ready"))
    if not args.skip_peer:
        assert server_exe is not None
        port = free_port()
        slots = max(args.concurrency)
        # Every slot holds a prompt plus max_tokens; llama-server splits -c over its slots.
        per_slot = 256 * math.ceil((args.max_tokens + 2 * PROMPT_TOKENS) / 256)
        cmd = [str(server_exe), "-m", str(peer_src), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
               "-t", str(args.threads), "-c", str(per_slot * slots), *args.peer_args.split()]
        servers.append(MeasuredServer("llama-server", cmd, port, extra, "/health"))
    return servers


def table(label: str, servers: list[MeasuredServer], rows: list[list[dict]], limit: float) -> str:
    lines = [f"**{label}**", "",
             "| c | server | out tok/s | c=1 limit tok/s (share) | TTFT p50 ms | ITL p50 ms | RSS after ready MiB "
             "| ready s |", "|---|---|---|---|---|---|---|---|"]
    for i, row in enumerate(rows[0]):
        c = row["concurrency"]
        for srv, srv_rows in zip(servers, rows):
            r = srv_rows[i]
            lim = f"{limit:.1f} ({r['tok_s'] / limit:.0%})" if c == 1 else ""
            lines.append(f"| {c} | {srv.name} | {r['tok_s']:.1f} | {lim} | {r['ttft_p50'] * 1000:.0f} | "
                         f"{r['itl_p50'] * 1000:.1f} | {srv.rss_ready / 2**20:.0f} | {srv.ready_s:.1f} |")
        if len(servers) == 2:
            a, b = rows[0][i], rows[1][i]
            ours, peer = servers
            lines.append(f"| {c} | **ratio llmserve/llama-server** (rounds: {round_ratios(a, b)}) | "
                         f"**{a['tok_s'] / b['tok_s']:.2f}x** | | {a['ttft_p50'] / b['ttft_p50']:.2f} | "
                         f"{a['itl_p50'] / b['itl_p50']:.2f} | {ours.rss_ready / max(peer.rss_ready, 1):.2f} | "
                         f"{ours.ready_s / peer.ready_s:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = bench_args.new_parser(__doc__)
    ap.add_argument("--models", nargs="+", default=None, help="GGUF files (default: bench/make_models.py's)")
    ap.add_argument("--small", action="store_true", help="the ~300 MB model set instead of the 1B-shaped one")
    ap.add_argument("--models-dir", default=str(make_models.DEFAULT_DIR))
    ap.add_argument("--family", default="llama", choices=sorted(make_models.FAMILIES),
                    help="which bench/make_models.py set (its --family)")
    ap.add_argument("--quants", nargs="+", default=["Q8_0", "Q4_K_M", "Q4_0", "bf16"],
                    choices=["Q8_0", "Q4_K_M", "Q4_0", "BF16", "bf16"],
                    help="which files of the make_models set; bf16: llmserve on the safetensors directory "
                         "vs llama-server on the BF16 GGUF (BF16: both on the BF16 GGUF)")
    bench_args.add_levels(ap)
    ap.add_argument("--skip-llmserve", action="store_true", help="only benchmark llama-server")
    ap.add_argument("--skip-peer", action="store_true", help="only benchmark llmserve")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server -t")
    ap.add_argument("--llama-cpp", default=None, help="folder holding llama-server (default: PATH, else built)")
    ap.add_argument("--llmserve-args", default="", help="extra flags for llmserve serve")
    ap.add_argument("--peer-args", default="", help="extra flags for llama-server")
    ap.add_argument("--bandwidth-gib", type=float, default=2.0, help="buffer size of the bandwidth measurement")
    ap.add_argument("--busy", type=int, default=0, metavar="N",
                    help="processes that spin a core each while the servers start and run")
    bench_args.add_outputs(ap, "append the result tables to this file")
    args = ap.parse_args()
    if args.skip_llmserve and args.skip_peer:
        sys.exit("nothing to run: both --skip-llmserve and --skip-peer")
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    lines = model_set(args)
    server_exe = None if args.skip_peer else llama_cpp.ensure(args.llama_cpp).server
    bandwidth = memory_bandwidth(args.bandwidth_gib)
    print(f"memory read bandwidth: {bandwidth / 1e9:.1f} GB/s ({args.bandwidth_gib:g} GiB buffer)", flush=True)
    tables, raw = [], []
    for label, ours_src, peer_src in lines:
        print(f"== {label}", flush=True)
        servers = servers_for(ours_src, peer_src, args, server_exe)
        with busy_processes(args.busy):
            rows = run_all(servers, args, env)
        limit = limit_tok_s(bandwidth, peer_src, args.max_tokens)
        tables.append(table(label, servers, rows, limit))
        print(tables[-1], flush=True)
        raw.append({"model": label, "limit_tok_s": limit, "servers": [
            {"name": s.name, "ready_s": s.ready_s, "rss_ready": s.rss_ready, "rss_end": s.rss_end,
             "levels": [{k: v for k, v in r.items() if k not in ("ttft", "itl")} for r in srv_rows]}
            for s, srv_rows in zip(servers, rows)]})
    md = "\n\n".join(tables)
    header = (f"\n### {time.strftime('%Y-%m-%d')} — GGUF: llmserve vs llama-server, {platform.machine()}, "
              f"{os.cpu_count()} cores, memory read bandwidth {bandwidth / 1e9:.1f} GB/s, "
              f"max_tokens {args.max_tokens}{f', {args.busy} busy process(es)' if args.busy else ''}\n\n"
              f"Command: `python bench/gguf_bench.py {' '.join(sys.argv[1:])}`\n\n")
    print(header + md)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(header + md + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"bandwidth_bytes_s": bandwidth, "models": raw}, indent=2))


if __name__ == "__main__":
    main()
