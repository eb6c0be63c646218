"""Vision-language models served: image encode time, time to first token with an image (new, and
resent in a later turn), and decode speed, on a SmolVLM-256M-shaped Idefics3 (SigLIP base at 512
pixels, a pixel shuffle of 4, SmolLM2-135M's language model: tests/vision_model.py's
``smolvlm-256m`` shape, random weights, fp32) made once under ~/.cache/llmserve/bench-models.

An image of ``--image-size`` pixels is cut by SmolVLM's processor into 512-pixel tiles plus a
global tile, 64 image tokens each (1024x768: 2x2 tiles + 1, 320 tokens). The encode time is the
vision tower and projector in-process (median of three, the encoder cache bypassed); the served
numbers come from streamed chat completions, one request at a time: ``new image`` sends a
picture the server has not seen, ``same image again`` resends the previous request's picture
and text (the encoder cache and the prefix cache both hit), ``text only`` the same question
without an image.

    python bench/vision_bench.py
    python bench/vision_bench.py --image-size 2048x1536 --max-tokens 64 --requests 4
"""

from __future__ import annotations

import base64
import json
import os
import statistics
import sys
import time
from pathlib import Path

import bench_args  # bench/bench_args.py: the script's folder is first on sys.path
import httpx
from serve_bench import free_port, start, stop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import vision_model  # tests/vision_model.py: the model and picture makers

QUESTION = "Describe the picture in detail."
MODELS = Path(os.path.expanduser("~/.cache/llmserve/bench-models"))


def model_dir() -> str:
    path = MODELS / "smolvlm-256m-shape"
    if not (path / "config.json").exists():
        print(f"writing a SmolVLM-256M-shaped model to {path}", flush=True)
        vision_model.write_idefics3(str(path), shape="smolvlm-256m")
    return str(path)


def encode_ms(path: str, size: tuple[int, int]) -> tuple[float, int]:
    """(median ms to encode one image, its image tokens), in-process."""
    from llmserve.config import ServerConfig
    from llmserve.engine.backend import KVCacheSpec
    from llmserve.media.inputs import MediaInput
    from llmserve.plugins.backends.torch.runner import TorchBackend

    backend = TorchBackend(ServerConfig(model=path, dtype="float32", device="cpu"))
    info = backend.info = backend.load()
    backend.init_kv_cache(KVCacheSpec(block_size=16, num_blocks=64))
    ids = info.tokenizer("<image>", add_special_tokens=False)["input_ids"]
    _, (image,) = info.media.expand(ids, [vision_model.picture(0, size)], "bench")
    times = []
    for k in range(3):
        t0 = time.perf_counter()
        feats = backend.vision.features(MediaInput(f"bench-{k}", image.start, image.end, image.data))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000, int(feats.shape[0])


def chat(url: str, content: list | str, max_tokens: int) -> tuple[float, float, int]:
    """(TTFT s, decode tok/s after the first token, prompt tokens) of one streamed chat."""
    body = {"model": "vlm", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "min_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    tokens = prompt = 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                prompt = event["usage"]["prompt_tokens"]
            if event["choices"] and event["choices"][0]["delta"].get("content") is not None:
                last = time.perf_counter()
                first = first or last
                tokens += 1
    assert first is not None and last is not None
    return first - t0, (tokens - 1) / (last - first) if last > first else float("nan"), prompt


def image_part(seed: int, size: tuple[int, int]) -> dict:
    url = "data:image/png;base64," + base64.b64encode(vision_model.png(seed, size)).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def main() -> None:
    ap = bench_args.new_parser(__doc__)
    ap.add_argument("--image-size", default="1024x768", help="WIDTHxHEIGHT of the test pictures")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=3, help="requests per measurement")
    ap.add_argument("--log-dir", default="bench/logs")
    args = ap.parse_args()
    size = tuple(int(v) for v in args.image_size.split("x"))
    path = model_dir()
    ms, image_tokens = encode_ms(path, size)
    print(f"encode: {ms:.0f} ms for one {args.image_size} image ({image_tokens} image tokens)", flush=True)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    os.makedirs(args.log_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "llmserve", "serve", path, "--port", str(port), "--dtype", "float32",
           "--served-model-name", "vlm", "--log-level", "warning"]
    t0 = time.perf_counter()
    proc = start(cmd, port, Path(args.log_dir) / "vision-llmserve.log", dict(os.environ))
    ready = time.perf_counter() - t0
    rows: dict[str, list[tuple[float, float, int]]] = {"new image": [], "same image again": [], "text only": []}
    try:
        chat(url, [image_part(999, size), {"type": "text", "text": QUESTION}], 4)  # warm-up
        for k in range(args.requests):
            content = [image_part(k, size), {"type": "text", "text": QUESTION}]
            rows["new image"].append(chat(url, content, args.max_tokens))
            rows["same image again"].append(chat(url, content, args.max_tokens))
            rows["text only"].append(chat(url, QUESTION, args.max_tokens))
    finally:
        stop(proc)
    print(f"\nSmolVLM-256M shape, fp32, CPU; {args.image_size} image ({image_tokens} image tokens), "
          f"ready in {ready:.1f} s")
    print("| request | prompt tokens | TTFT p50 (ms) | decode tok/s p50 |")
    print("|---|---|---|---|")
    for name, samples in rows.items():
        ttft = statistics.median(s[0] for s in samples) * 1000
        tps = statistics.median(s[1] for s in samples)
        print(f"| {name} | {samples[0][2]} | {ttft:.0f} | {tps:.1f} |")


if __name__ == "__main__":
    main()
