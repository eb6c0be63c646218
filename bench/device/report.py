"""The device run's one table, from the JSON lines run.sh's sections appended.

    python bench/device/report.py RESULTS.jsonl [SERVE.json]
"""

from __future__ import annotations

import json
import os
import sys


def append_jsonl(path: str | None, row: dict) -> None:
    """Append ``row`` as one JSON line to ``path`` (nothing when no path is given)."""
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps(row) + "\n")


def main() -> None:
    rows = []
    if os.path.exists(sys.argv[1]):
        with open(sys.argv[1]) as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
    serve = {}
    if len(sys.argv) > 2 and os.path.exists(sys.argv[2]):
        with open(sys.argv[2]) as fh:
            serve = {r["concurrency"]: r for r in json.load(fh).get("llmserve") or []}

    def by(name: str) -> list[dict]:
        return [r for r in rows if r.get("section") == name and "status" not in r]

    print("\n# device run")
    for r in rows:
        if "status" in r:
            print(f"- {r['section']}: {r['status']}")
    for r in by("ceilings"):
        print(f"- ceilings: copy {r['bandwidth_gbs']:.0f} GB/s (read + write), bf16 matmul {r['tflops']:.0f} TFLOP/s")
    for r in by("greedy"):
        print(f"- greedy ({r['flags']}): {r['same']}/{r['of']} identical to transformers generate")
    if by("kernels"):
        print("\n| batch | ctx | Triton µs | GB/s | SDPA gather µs | GB/s | speed-up |\n|---|---|---|---|---|---|---|")
        for r in by("kernels"):
            print(f"| {r['batch']} | {r['ctx']} | {r['triton_us']:.1f} | {r['triton_gbs']:.0f} | {r['sdpa_us']:.1f} | "
                  f"{r['sdpa_gbs']:.0f} | {r['sdpa_us'] / r['triton_us']:.1f}x |")
    hf = {r["batch"]: r for r in by("hf_compiled")}
    engine = by("engine")
    if engine:
        print("\n| run | c | tok/s | ms/step | graphed | floor ms | of floor | bound | HF compiled tok/s | vs HF "
              "| served tok/s |\n|---|---|---|---|---|---|---|---|---|---|---|")
        for r in engine:
            c, peer, srv = r["concurrency"], hf.get(r["concurrency"]), serve.get(r["concurrency"])
            step, floor = r.get("decode_step_ms"), r.get("floor_ms")
            of = f"{100 * floor / step:.0f}%" if step and floor else "-"
            vs = f"{r['tok_s'] / peer['tok_s']:.2f}x" if peer else "-"
            served = f"{srv['tok_s']:.0f} ({srv['tok_s'] / r['tok_s']:.2f})" if srv and r["label"] == "graphs" else "-"
            print(f"| {r['label']} | {c} | {r['tok_s']:.0f} | {step or 0:.2f} | {r['graphed_pct']:.0f}% | "
                  f"{floor or 0:.3f} | {of} | {r.get('bound') or '-'} | {peer['tok_s'] if peer else 0:.0f} | {vs} "
                  f"| {served} |")
    for c, s in sorted(serve.items()):
        print(f"- served c={c}: {s['tok_s']:.0f} tok/s, TTFT p50 {s['ttft_p50'] * 1e3:.1f} ms p99 "
              f"{s['ttft_p99'] * 1e3:.1f} ms, ITL p50 {s['itl_p50'] * 1e3:.2f} ms p99 {s['itl_p99'] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
