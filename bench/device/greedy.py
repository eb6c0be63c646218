"""Greedy equality on CUDA: twelve prompts sent at once to ``llmserve serve`` (so they decode as
one batch, from CUDA graphs unless ``--enforce-eager`` is among the flags) against transformers'
``generate`` on the same fp32 weights, token for token.

    python bench/device/greedy.py MODEL_DIR [--json FILE] [-- extra llmserve serve flags]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPTS = ["The three primary colors are", "def fibonacci(n):\n    ", "Once upon a time in a small village,",
           "The chemical symbol for gold is", "To make a cup of tea, first", "In 1969, astronauts",
           "Translate to French: 'Good morning' ->", "A haiku about autumn:\n", "The quick brown fox",
           "Q: What is 12 times 12?\nA:", "Water boils at", "The largest planet in our solar system is"]
NEW = 40


def serve(model: str, flags: list[str], port: int, log_path: str) -> subprocess.Popen:
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "llmserve", "serve", model, "--device", "cuda", "--dtype", "float32",
                             "--port", str(port), "--served-model-name", "m", *flags],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 240
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited:\n{open(log_path).read()[-3000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            time.sleep(1)
    proc.kill()
    raise SystemExit("server did not start in 240 s")


def ask(port: int, prompt: str) -> list[int]:
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
                       "return_token_ids": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["token_ids"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--json", default=None)
    ap.add_argument("flags", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    flags = [f for f in args.flags if f != "--"]
    port = 18600 + len(flags)
    out_dir = os.environ.get("OUT", "/tmp")
    proc = serve(args.model, flags, port, os.path.join(out_dir, f"greedy-{port}.log"))
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            served = list(pool.map(lambda p: ask(port, p), PROMPTS))
    finally:
        proc.terminate()
        proc.wait(30)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).cuda().eval()
    same = 0
    for prompt, got in zip(PROMPTS, served):
        ids = tok(prompt, return_tensors="pt").input_ids.cuda()
        ref = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[0, ids.shape[1]:].tolist()
        if got == ref:
            same += 1
        else:
            first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
            print(f"differs from token {first}: {prompt!r}")
    label = " ".join(flags) or "default"
    print(f"greedy, {label}: {same}/{len(PROMPTS)} identical to transformers generate (fp32)")
    if args.json:
        with open(args.json, "a") as fh:
            fh.write(json.dumps({"section": "greedy", "flags": label, "same": same, "of": len(PROMPTS)}) + "\n")


if __name__ == "__main__":
    main()
