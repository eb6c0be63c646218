"""Speculative decoding, served: llmserve with and without ``--speculative-config`` (ngram) and
llama-server with and without its n-gram speculation, on the same GGUF, per workload.

Workloads (chat completions, greedy, streamed): ``code-edit`` (rewrite a quoted file with one
change: the answer repeats most of its prompt), ``summary`` (quote-heavy notes on a given text),
``agent`` (a tool result to restate in full), and ``chat`` (free writing: little to look up, the
case where speculation should cost nothing). Each server runs alone, started before and stopped
after its measurements; each workload at each concurrency sends ``--requests`` requests from
that many closed-loop clients. The table gives output tok/s per server and workload, the
speculating server over the plain one, and llmserve's speculating tok/s over llama-server's;
llmserve's acceptance (kept over proposed tokens) comes from its /metrics.

The default model is the embedded SmolLM2-135M-Instruct (real weights: random-weight models
do not repeat their prompts, so their acceptance says nothing).

``--draft FILE`` measures the ``draft`` method instead (llmserve ``--spec-draft-model FILE``,
llama-server ``-md FILE``, both with ``--spec-draft-n-max K``); ``--draft embedded`` runs the
only real draft/target pair that needs no download: the embedded Q4_1 file drafting for the
same weights as a BF16 GGUF (converted once with llama.cpp's converter into the bench-models
folder): a draft ~4x cheaper per token that agrees on nearly every token, the ceiling of what a
draft model gives at this cost ratio.

    python bench/spec_bench.py
    python bench/spec_bench.py --concurrency 1 8 --max-tokens 256 --peer-spec "--spec-type ngram-simple"
    python bench/spec_bench.py --draft embedded --concurrency 1 8
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import bench_args  # bench/bench_args.py: the script's folder is first on sys.path
import httpx
import llama_cpp
from serve_bench import Server, free_port

from llmserve.plugins.commands.bench.loadgen import run_closed_loop

FILE = '''import json
import os


def load_settings(path):
    """Read the settings file, or return the defaults."""
    if not os.path.exists(path):
        return {"theme": "light", "font_size": 12, "autosave": True}
    with open(path) as f:
        return json.load(f)


def save_settings(path, settings):
    """Write the settings file."""
    with open(path, "w") as f:
        json.dump(settings, f, indent=2)


def update_setting(path, key, value):
    settings = load_settings(path)
    settings[key] = value
    save_settings(path, settings)
    return settings
'''
ARTICLE = ("The city council met on Tuesday to discuss the new library. The library will open in March. "
           "It will have three floors, a children's room and a cafe. The council approved a budget of two "
           "million dollars. Construction starts next week. The mayor said the library is the most important "
           "project of the year. Residents asked for longer opening hours on weekends.")
TOOL = ('{"city": "Lisbon", "forecast": [{"day": "Monday", "high": 24, "low": 16, "sky": "sunny"}, '
        '{"day": "Tuesday", "high": 22, "low": 15, "sky": "cloudy"}, {"day": "Wednesday", "high": 19, '
        '"low": 14, "sky": "rain"}]}')
WORKLOADS = {
    "code-edit": [{"role": "user", "content": "Here is a Python file:\n\n```python\n" + FILE + "```\n\n"
                   "Rename the function update_setting to set_setting. Write the whole file again."}],
    "summary": [{"role": "user", "content": ARTICLE + "\n\nRepeat the text above sentence by sentence, "
                 "as a bulleted list."}],
    "agent": [{"role": "user", "content": "What is the weather in Lisbon this week?"},
              {"role": "assistant", "content": "Let me look it up."},
              {"role": "user", "content": "Tool result:\n" + TOOL + "\n\nShow the tool result to me exactly, "
               "then say which day is warmest."}],
    "chat": [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message "
              "in a bottle."}],
}


def embedded_bf16(args) -> tuple[str, str]:
    """(target, draft): the embedded SmolLM2's weights as a BF16 GGUF (made once), the Q4_1 file."""
    from make_models import DEFAULT_DIR, convert

    from llmserve.plugins.backends.torch.loader import embedded_model_path, hf_directory

    out = Path(DEFAULT_DIR).expanduser() / "SmolLM2-135M-Instruct-BF16.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert(llama_cpp.ensure(args.llama_cpp, need_source=True), Path(hf_directory(None)), out, "BF16")
    return str(out), embedded_model_path()


def servers(args, exe: Path | None) -> list[Server]:
    out = []
    if args.draft:
        ours = ["--spec-draft-model", args.draft, "--spec-draft-n-max", str(args.k)]
        theirs = ["-md", args.draft, "--spec-draft-n-max", str(args.k), "-td", str(args.threads)]
    else:
        ours = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": %d}' % args.k]
        theirs = args.peer_spec.split()
    for name, extra in (("llmserve", []), (f"llmserve+{args.method}", ours)):
        port = free_port()
        out.append(Server(name, [sys.executable, "-m", "llmserve", "serve", str(args.model), "--port", str(port),
                                 "--served-model-name", "bench", "--log-level", "warning", *extra], port, "bench", {}))
    if exe is not None:
        slots = max(args.concurrency)
        for name, extra in (("llama-server", []), (f"llama-server+{args.method}", theirs)):
            port = free_port()
            out.append(Server(name, [str(exe), "-m", str(args.model), "--host", "127.0.0.1", "--port", str(port),
                                     "-np", str(slots), "-t", str(args.threads), "-c", str(2048 * slots), *extra],
                              port, "bench", {}, ready_path="/health"))
    return out


def accepted(url: str) -> tuple[float, float]:
    """(accepted, proposed) tokens so far, from llmserve's /metrics (0, 0 elsewhere)."""
    got = {"vllm:spec_decode_num_accepted_tokens_total": 0.0, "vllm:spec_decode_num_draft_tokens_total": 0.0}
    try:
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            name = line.split("{")[0]
            if name in got:
                got[name] = float(line.rsplit(" ", 1)[1])
    except httpx.HTTPError:
        pass
    return got["vllm:spec_decode_num_accepted_tokens_total"], got["vllm:spec_decode_num_draft_tokens_total"]


def measure(srv: Server, args) -> dict:
    rows = {}
    for workload, messages in WORKLOADS.items():
        for c in args.concurrency:
            before = accepted(srv.url)
            bodies = [{"model": "bench", "messages": messages, "max_tokens": args.max_tokens, "temperature": 0.0,
                       "stream": True, "stream_options": {"include_usage": True}} for _ in range(max(args.requests, c))]
            run = asyncio.run(run_closed_loop(srv.url, "/v1/chat/completions", bodies, c, timeout=1800))
            tokens = sum(s.output_tokens for s in run.samples)
            after = accepted(srv.url)
            rate = (after[0] - before[0]) / (after[1] - before[1]) if after[1] > before[1] else None
            rows[workload, c] = {"tok_s": tokens / run.wall_s, "tokens": tokens, "acceptance": rate}
            print(f"  {srv.name} {workload} c={c}: {tokens / run.wall_s:.1f} tok/s ({tokens} tokens)"
                  + (f", acceptance {rate:.0%}" if rate is not None else ""), flush=True)
    return rows


def main() -> None:
    ap = bench_args.new_parser(__doc__)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2-135M)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests", type=int, default=4, help="requests per workload and level (at least c)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=4, help="llmserve's num_speculative_tokens")
    ap.add_argument("--peer-spec", default="--spec-type ngram-simple", help="llama-server's speculation flags")
    ap.add_argument("--draft", default=None, help="a draft model file: measure the draft method, not ngram "
                    "(embedded: the embedded Q4_1 file drafting for its weights as BF16)")
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--llama-cpp", default=None)
    ap.add_argument("--log-dir", default="/tmp/llmserve-spec-bench")
    args = ap.parse_args()
    args.method = "draft" if args.draft else "ngram"
    if args.draft == "embedded":
        target, args.draft = embedded_bf16(args)
        args.model = args.model or target
    if args.model is None:
        from llmserve.plugins.backends.torch.loader import embedded_model_path

        args.model = embedded_model_path()
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    exe = None if args.skip_peer else llama_cpp.ensure(args.llama_cpp).server
    results = {}
    for srv in servers(args, exe):
        srv.start(args.log_dir, env)  # ready, then two short warm-up requests
        try:
            results[srv.name] = measure(srv, args)
        finally:
            srv.stop()
    names = list(results)
    m = args.method
    drafted = f", draft {Path(args.draft).name}" if args.draft else ""
    lines = [f"### {time.strftime('%Y-%m-%d')} — speculative decoding, {Path(str(args.model)).name}{drafted}, "
             f"max_tokens {args.max_tokens}", "", f"Command: `python bench/spec_bench.py {' '.join(sys.argv[1:])}`",
             "", "| workload | c | " + " | ".join(f"{n} tok/s" for n in names) + f" | llmserve {m}/plain | "
             f"llmserve {m} / llama-server {m} | acceptance |", "|---" * (len(names) + 5) + "|"]
    for (workload, c), _ in results[names[0]].items():
        cells = [f"{results[n][workload, c]['tok_s']:.1f}" for n in names]
        ours = results[f"llmserve+{m}"][workload, c]
        gain = ours["tok_s"] / results["llmserve"][workload, c]["tok_s"]
        peer = (f"{ours['tok_s'] / results[f'llama-server+{m}'][workload, c]['tok_s']:.2f}x"
                if f"llama-server+{m}" in results else "")
        rate = f"{ours['acceptance']:.0%}" if ours["acceptance"] is not None else ""
        lines.append(f"| {workload} | {c} | " + " | ".join(cells) + f" | {gain:.2f}x | {peer} | {rate} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
