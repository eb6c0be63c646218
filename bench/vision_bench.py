"""Vision-language models served: image encode time, time to first token with an image (new, and
resent in a later turn), and decode speed, on a model of ``--shape`` (random weights, fp32, made
once under ~/.cache/llmserve/bench-models by tests/vision_model.py):

- ``smolvlm-256m``: SmolVLM-256M's Idefics3 (SigLIP base at 512 pixels, a pixel shuffle of 4,
  SmolLM2-135M's language model). An image of ``--image-size`` pixels is cut by SmolVLM's
  processor into 512-pixel tiles plus a global tile, 64 image tokens each (1024x768: 2x2 tiles
  + 1, 320 tokens).
- ``qwen2.5-vl-3b``: Qwen2.5-VL-3B-Instruct's (a 32-layer windowed vision tower of 14-pixel
  patches merged 2x2, a 36-layer Qwen2 language model with positions along three axes): one image
  token per 28x28 pixels (1024x768: 1014 tokens).
- ``gemma3-4b``: Gemma 3 4B's (a 27-layer SigLIP so400m tower at 896 pixels, its 4096 patches
  pooled into 256 image tokens that attend to each other both ways; a 34-layer Gemma 3 language
  model), made in bfloat16 and converted to F16 files (F32 ones would not fit beside it on disk).
 The encode time is the
vision tower and projector in-process (median of three, the encoder cache bypassed); the served
numbers come from streamed chat completions, one request at a time: ``new image`` sends a
picture the server has not seen, ``same image again`` resends the previous request's picture
and text (the encoder cache and the prefix cache both hit), ``text only`` the same question
without an image.

    python bench/vision_bench.py
    python bench/vision_bench.py --image-size 2048x1536 --max-tokens 64 --requests 4
    python bench/vision_bench.py --shape qwen2.5-vl-3b --max-tokens 16 --requests 2
    python bench/vision_bench.py --gguf      # both servers on the same text GGUF and mmproj files
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
import llama_cpp
from make_models import converter_requirements, run_quietly
from serve_bench import free_port, start, stop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import vision_gemma3  # tests/vision_gemma3.py: Gemma 3's
import vision_model  # tests/vision_model.py: the model and picture makers

QUESTION = "Describe the picture in detail."
MODELS = Path(os.path.expanduser("~/.cache/llmserve/bench-models"))


WRITERS = {"smolvlm-256m": vision_model.write_idefics3, "qwen2.5-vl-3b": vision_model.write_qwen2_5_vl,
           "gemma3-4b": lambda path, shape: hub_layout(vision_gemma3.write_gemma3(path, shape=shape,
                                                                                  dtype="bfloat16"))}
# The converter's output type per shape (F32 unless the files would not fit).
OUTTYPES = {"gemma3-4b": "f16"}


def hub_layout(path: str) -> str:
    """A Gemma 3 folder's vision tower under the names its Hub checkpoints use
    (``vision_tower.vision_model.``), which llama.cpp's converter reads; transformers reads both."""
    from safetensors.torch import load_file, save_file

    index = Path(path) / "model.safetensors.index.json"
    files = sorted({*json.loads(index.read_text())["weight_map"].values()}) if index.exists() else ["model.safetensors"]
    rename = {}
    for name in files:
        tensors = load_file(str(Path(path) / name))
        moved = {("vision_tower.vision_model." + k.removeprefix("vision_tower.")
                  if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.") else k): v
                 for k, v in tensors.items()}
        rename |= {k: new for k, new in zip(tensors, moved) if k != new}
        save_file(moved, str(Path(path) / name), metadata={"format": "pt"})
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {rename.get(k, k): v for k, v in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=2))
    return path


def model_dir(shape: str) -> str:
    path = MODELS / f"{shape}-shape"
    if not (path / "config.json").exists():
        print(f"writing a {shape}-shaped model to {path}", flush=True)
        WRITERS[shape](str(path), shape=shape)
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
    ids = info.tokenizer(info.media.placeholder, add_special_tokens=False)["input_ids"]
    _, (image,) = info.media.expand(ids, [vision_model.picture(0, size)], "bench")
    times = []
    for k in range(3):
        t0 = time.perf_counter()
        feats = backend.vision.features(MediaInput(f"bench-{k}", image.start, image.end, image.data))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000, int(feats.shape[1])


def peer_files(tools: llama_cpp.LlamaCpp, path: str) -> tuple[Path, Path]:
    """(text GGUF, mmproj GGUF) of the folder, converted by llama.cpp's converter when missing."""
    out, name = Path(path).parent, Path(path).name
    outtype = OUTTYPES.get(name.removesuffix("-shape"), "f32")
    text, mmproj = out / f"{name}-{outtype.upper()}.gguf", out / f"mmproj-{name}-{outtype.upper()}.gguf"
    converter_requirements()
    for target, extra in ((text, []), (mmproj, ["--mmproj"])):
        if target.exists():
            continue
        # The converter names an mmproj file itself (an "mmproj-" prefix): convert into a folder of its own.
        tmp = out / (target.name + ".partial")
        tmp.mkdir(exist_ok=True)
        cmd = [sys.executable, str(tools.converter), path, "--outfile", str(tmp / "out.gguf"), "--outtype", outtype,
               *extra]
        print("converting: " + " ".join(cmd), flush=True)
        run_quietly(cmd, env=tools.converter_env())
        (made,) = tmp.glob("*.gguf")
        made.rename(target)
        tmp.rmdir()
    return text, mmproj


def chat(url: str, content: list | str, max_tokens: int) -> tuple[float, float, int]:
    """(TTFT s, decode tok/s after the first token, prompt tokens) of one streamed chat."""
    body = {"model": "vlm", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "min_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
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


def measure(name: str, cmd: list[str], url: str, port: int, log_dir: str, size: tuple[int, int],
            requests: int, max_tokens: int) -> dict[str, list[tuple[float, float, int]]]:
    """One server: started, warmed with one image, measured, stopped; with its time to ready."""
    t0 = time.perf_counter()
    proc = start(cmd, port, Path(log_dir) / f"vision-{name}.log", dict(os.environ),
                 "/ready" if name == "llmserve" else "/health")
    rows: dict[str, list[tuple[float, float, int]]] = {"ready": [(time.perf_counter() - t0, 0.0, 0)],
                                                      "new image": [], "same image again": [], "text only": []}
    try:
        chat(url, [image_part(999, size), {"type": "text", "text": QUESTION}], 4)  # warm-up
        for k in range(requests):
            content = [image_part(k, size), {"type": "text", "text": QUESTION}]
            rows["new image"].append(chat(url, content, max_tokens))
            rows["same image again"].append(chat(url, content, max_tokens))
            rows["text only"].append(chat(url, QUESTION, max_tokens))
    finally:
        stop(proc)
    return rows


def main() -> None:
    ap = bench_args.new_parser(__doc__)
    ap.add_argument("--shape", choices=sorted(WRITERS), default="smolvlm-256m", help="the model's shape")
    ap.add_argument("--image-size", default="1024x768", help="WIDTHxHEIGHT of the test pictures")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=3, help="requests per measurement")
    ap.add_argument("--log-dir", default="bench/logs")
    ap.add_argument("--skip-peer", action="store_true", help="llmserve alone")
    ap.add_argument("--skip-encode", action="store_true", help="no in-process encode timing")
    ap.add_argument("--gguf", action="store_true", help="llmserve serves llama-server's files too (the text GGUF "
                                                       "with --mmproj) instead of the Hugging Face folder")
    ap.add_argument("--llama-cpp", default=None, help="a llama.cpp build folder (default: found or built)")
    args = ap.parse_args()
    size = tuple(int(v) for v in args.image_size.split("x"))
    path = model_dir(args.shape)
    if not args.skip_encode:
        ms, image_tokens = encode_ms(path, size)
        print(f"encode: {ms:.0f} ms for one {args.image_size} image ({image_tokens} image tokens)", flush=True)
    os.makedirs(args.log_dir, exist_ok=True)
    port = free_port()
    served = [path]
    if args.gguf or not args.skip_peer:
        tools = llama_cpp.ensure(args.llama_cpp, need_source=True)
        text, mmproj = peer_files(tools, path)
        served = [str(text), "--mmproj", str(mmproj)] if args.gguf else served
    servers = {"llmserve": [sys.executable, "-m", "llmserve", "serve", *served, "--port", str(port), "--dtype",
                            "float32", "--served-model-name", "vlm", "--log-level", "warning"]}
    if not args.skip_peer:
        servers["llama-server"] = [str(tools.server), "-m", str(text), "--mmproj", str(mmproj), "--port", str(port),
                                   "-c", "4096", "--jinja", "-t", str(os.cpu_count() or 1)]
    results = {name: measure(name, cmd, f"http://127.0.0.1:{port}", port, args.log_dir, size, args.requests,
                             args.max_tokens) for name, cmd in servers.items()}
    print(f"\n{args.shape} shape, fp32, CPU; {args.image_size} images; llmserve serves "
          + ("the GGUF and mmproj" if args.gguf else "the Hugging Face folder"))
    print("| server | request | prompt tokens | TTFT p50 (ms) | decode tok/s p50 |")
    print("|---|---|---|---|---|")
    for name, rows in results.items():
        print(f"| {name} | time to ready | | {rows['ready'][0][0] * 1000:.0f} | |")
        for what in ("new image", "same image again", "text only"):
            samples = rows[what]
            ttft = statistics.median(s[0] for s in samples) * 1000
            tps = statistics.median(s[1] for s in samples)
            print(f"| {name} | {what} | {samples[0][2]} | {ttft:.0f} | {tps:.1f} |")


if __name__ == "__main__":
    main()
