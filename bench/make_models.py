"""Random-weight benchmark models of real size, as a Hugging Face directory and as GGUF files.

The default model has Llama-3.2-1B's shape (hidden 2048, 16 layers, intermediate 8192, 32
heads, 8 KV heads, head_dim 64, rope_theta 500000, a 131072-token context, tied embeddings)
with SmolLM2's 49152-token vocabulary, tokenizer and chat template (taken from the embedded
model); ``--small`` makes a
~300 MB model of the same family for quick runs. ``--family qwen3`` makes Qwen3-1.7B's shape
(hidden 2048, 28 layers, intermediate 6144, 16 heads of 128, 8 KV heads, q/k norms, rope_theta
1000000, a 40960-token context, tied embeddings) with the same vocabulary, ``--family gemma3``
Gemma 3 1B's (hidden 1152, 26 layers, intermediate 6912, 4 heads of 256, 1 KV head, five
512-token sliding-window layers to each global one, GELU, sandwich norms), ``--family qwen3_5``
a Qwen3.5-0.8B-like hybrid (hidden 1024, 24 layers: three Gated DeltaNet layers of 16 heads of 128
to each gated full-attention layer of 8 heads of 256 with 2 KV heads, intermediate 3584, partial
RoPE), ``--family gemma4`` Gemma 4 E2B's (hidden 1536, 35 layers, one KV head, sliding layers of
256-wide heads and every fifth global with 512-wide ones, the last 20 reading earlier layers'
keys, per-layer embeddings) with a 32768-token Gemma-style tokenizer trained here on the docs
(llama.cpp's converter takes only a sentencepiece-style BPE with byte fallback for Gemma 4; the
real vocabulary of 262144 would not fit this machine's disk). Weights are seeded random (normal,
std 0.02 as Llama's initializer_range) saved in bf16 with ``save_pretrained``; the GGUF files
come from llama.cpp's own tools: ``convert_hf_to_gguf.py`` writes BF16 and Q8_0, and
``llama-quantize`` makes Q4_K_M and Q4_0 from the BF16 file (see bench/llama_cpp.py for
where they come from). Files that exist are kept.

    python bench/make_models.py              # ~/.cache/llmserve/bench-models/llama-1b-shape*
    python bench/make_models.py --small
    python bench/make_models.py --family qwen3   # ~/.cache/llmserve/bench-models/qwen3-1.7b-shape*
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import llama_cpp  # bench/llama_cpp.py: the script's folder is first on sys.path

DEFAULT_DIR = Path.home() / ".cache" / "llmserve" / "bench-models"
_LLAMA = dict(model_type="llama", head_dim=64, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5)
SHAPES = {
    "llama-1b-shape": dict(_LLAMA, hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
                           num_attention_heads=32, num_key_value_heads=8),
    "llama-small-shape": dict(_LLAMA, hidden_size=768, num_hidden_layers=12, intermediate_size=3072,
                              num_attention_heads=12, num_key_value_heads=4),
    "qwen3-1.7b-shape": dict(model_type="qwen3", hidden_size=2048, num_hidden_layers=28, intermediate_size=6144,
                             num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                             max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "gemma3-1b-shape": dict(model_type="gemma3_text", hidden_size=1152, num_hidden_layers=26, intermediate_size=6912,
                            num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                            sliding_window=512, max_position_embeddings=32768, rope_theta=1000000.0,
                            rope_local_base_freq=10000.0, rms_norm_eps=1e-6),
    "qwen3.5-0.8b-shape": dict(model_type="qwen3_5_text", hidden_size=1024, num_hidden_layers=24,
                               intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                               linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                               linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=32768,
                               rope_parameters=dict(rope_type="default", rope_theta=10000000.0,
                                                    partial_rotary_factor=0.25),
                               rms_norm_eps=1e-6),
    # Gemma 4 E2B's shape (35 layers of hidden 1536, 8 query heads and one KV head, sliding layers of
    # 256-wide heads with a 512-token window, every fifth layer global with 512-wide heads rotating a
    # quarter of each, the last 20 layers reading earlier ones' keys with a double-wide MLP,
    # per-layer embeddings of 256 per layer), with a 32768-token Gemma-style vocabulary (GEMMA_VOCAB)
    # instead of its 262144 so that the files fit this machine's disk.
    "gemma4-e2b-shape": dict(model_type="gemma4_text", hidden_size=1536, num_hidden_layers=35,
                             intermediate_size=6144, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
                             global_head_dim=512, sliding_window=512, num_kv_shared_layers=20,
                             use_double_wide_mlp=True, hidden_size_per_layer_input=256,
                             vocab_size_per_layer_input=32768, final_logit_softcapping=30.0,
                             layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7,
                             max_position_embeddings=131072, rms_norm_eps=1e-6),
}
# Models whose tokenizer is a Gemma-style one (sentencepiece BPE with byte fallback: llama.cpp's
# converter takes no other for them) made by gemma_tokenizer, of this many tokens.
GEMMA_VOCAB = {"gemma4-e2b-shape": 32768}
# --family -> (default model, --small model)
FAMILIES = {"llama": ("llama-1b-shape", "llama-small-shape"), "qwen3": ("qwen3-1.7b-shape", None),
            "gemma3": ("gemma3-1b-shape", None), "qwen3_5": ("qwen3.5-0.8b-shape", None),
            "gemma4": ("gemma4-e2b-shape", None)}
CONVERTER_TYPES = ("BF16", "Q8_0")  # written by convert_hf_to_gguf.py
# Converter flags by model: a Qwen3.5 checkpoint carries a multi-token-prediction layer, which the
# converter looks for unless told there is none.
CONVERTER_FLAGS = {"qwen3.5-0.8b-shape": ["--no-mtp"]}
QUANTIZE_TYPES = ("Q4_K_M", "Q4_0")  # written by llama-quantize from the BF16 file
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def gguf_path(models_dir: Path, name: str, qtype: str) -> Path:
    return models_dir / f"{name}-{qtype}.gguf"


def size_text(path: Path) -> str:
    total = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size
    return f"{total / 1e9:.2f} GB" if total >= 1e9 else f"{total / 1e6:.0f} MB"


def gemma_tokenizer(out: Path, size: int) -> dict:
    """A Gemma-style tokenizer of ``size`` tokens written to ``out``: a sentencepiece-style BPE with
    byte fallback (spaces as U+2581) trained on this repository's docs, padded with unused tokens
    as Gemma's vocabulary is, with Gemma's turn markers and chat template; returns its special ids."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    special = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    docs = sorted(str(p) for p in (Path(__file__).resolve().parent.parent / "docs").glob("*.md"))
    tok.train(docs, trainers.BpeTrainer(vocab_size=min(size, 8000), show_progress=False,
                                        special_tokens=special + [f"<0x{b:02X}>" for b in range(256)]))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for i in range(size - len(vocab)):
        vocab[f"<unused{i}>"] = len(vocab)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    template = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
                "else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}"
                "<start_of_turn>model\n{% endif %}")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<end_of_turn>",
        "pad_token": "<pad>", "unk_token": "<unk>", "chat_template": template}))
    return {"vocab_size": size, "bos_token_id": 2, "eos_token_id": 5, "pad_token_id": 0}


def write_hf_model(out: Path, shape: dict, seed: int) -> None:
    """A seeded random model of ``shape`` (its ``model_type`` and config values) with the
    embedded SmolLM2's tokenizer (or, for a GEMMA_VOCAB model, a Gemma-style one)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmserve.plugins.backends.torch.loader import hf_directory

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    gemma = out.name in GEMMA_VOCAB
    tok_dir = tmp if gemma else Path(hf_directory(None))
    ref = gemma_tokenizer(tmp, GEMMA_VOCAB[out.name]) if gemma else json.loads((tok_dir / "config.json").read_text())
    values = dict(shape)
    config = AutoConfig.for_model(values.pop("model_type"), **values, vocab_size=ref["vocab_size"],
                                  tie_word_embeddings=True, initializer_range=0.02,
                                  bos_token_id=ref.get("bos_token_id"), eos_token_id=ref.get("eos_token_id"),
                                  pad_token_id=ref.get("pad_token_id"))
    torch.manual_seed(seed)
    print(f"initialising {out.name}: {shape}", flush=True)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(tmp, max_shard_size="8GB")
    for name in TOKENIZER_FILES if not gemma else ():
        if (tok_dir / name).is_file():
            shutil.copy(tok_dir / name, tmp / name)
    tmp.rename(out)  # only a finished directory carries the final name


def run_quietly(cmd: list[str], env: dict[str, str] | None = None) -> None:
    """Run a llama.cpp tool; its per-tensor log is shown only when it fails."""
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        print("\n".join(proc.stdout.splitlines()[-30:]), file=sys.stderr)
        raise SystemExit(f"{Path(cmd[1] if cmd[0] == sys.executable else cmd[0]).name} failed "
                         f"(exit {proc.returncode})")


def converter_requirements() -> None:
    """The converter imports sentencepiece even for a tokenizer.json model: pip-install it into
    this environment when missing (bench-only, like llama.cpp itself)."""
    import importlib.util

    if importlib.util.find_spec("sentencepiece") is None:
        print("pip-installing sentencepiece for convert_hf_to_gguf.py", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "sentencepiece"], check=True)


def convert(tools: llama_cpp.LlamaCpp, hf_dir: Path, out: Path, qtype: str) -> None:
    converter_requirements()
    tmp = out.with_name(out.name + ".partial")
    cmd = [sys.executable, str(tools.converter), str(hf_dir), "--outfile", str(tmp), "--outtype", qtype.lower(),
           *CONVERTER_FLAGS.get(hf_dir.name, [])]
    print("converting: " + " ".join(cmd), flush=True)
    run_quietly(cmd, env=tools.converter_env())
    tmp.rename(out)


def quantize(tools: llama_cpp.LlamaCpp, source: Path, out: Path, qtype: str, threads: int) -> None:
    tmp = out.with_name(out.name + ".partial")
    cmd = [str(tools.quantize), str(source), str(tmp), qtype, str(threads)]
    print("quantizing: " + " ".join(cmd), flush=True)
    run_quietly(cmd)
    tmp.rename(out)


def make(name: str, models_dir: Path, tools: llama_cpp.LlamaCpp | None, seed: int, threads: int) -> dict[str, Path]:
    """Every file of model ``name`` (made when missing); returns the paths by type ("hf", "BF16", ...)."""
    models_dir.mkdir(parents=True, exist_ok=True)
    hf_dir = models_dir / name
    if not (hf_dir / "config.json").is_file():
        write_hf_model(hf_dir, SHAPES[name], seed)
    paths: dict[str, Path] = {"hf": hf_dir}
    if tools is None:
        return paths
    for qtype in CONVERTER_TYPES:
        paths[qtype] = gguf_path(models_dir, name, qtype)
        if not paths[qtype].is_file():
            convert(tools, hf_dir, paths[qtype], qtype)
    for qtype in QUANTIZE_TYPES:
        paths[qtype] = gguf_path(models_dir, name, qtype)
        if not paths[qtype].is_file():
            quantize(tools, paths["BF16"], paths[qtype], qtype, threads)
    return paths


def model_name(family: str, small: bool = False) -> str:
    """The model ``--family``/``--small`` pick."""
    name = FAMILIES[family][1 if small else 0]
    if name is None:
        raise SystemExit(f"there is no small {family} model; leave out --small")
    return name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="the ~300 MB model instead of the 1B-shaped one")
    ap.add_argument("--family", default="llama", choices=sorted(FAMILIES), help="the shape's architecture")
    ap.add_argument("--models-dir", default=str(DEFAULT_DIR))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="llama-quantize threads")
    ap.add_argument("--hf-only", action="store_true", help="only the safetensors directory (no llama.cpp needed)")
    ap.add_argument("--llama-cpp", default=None, help="folder holding llama-server and llama-quantize")
    args = ap.parse_args()
    name = model_name(args.family, args.small)
    tools = None if args.hf_only else llama_cpp.ensure(args.llama_cpp, need_source=True)
    paths = make(name, Path(args.models_dir).expanduser(), tools, args.seed, args.threads)
    for kind, path in paths.items():
        print(f"{kind:>7}  {size_text(path):>9}  {path}")


if __name__ == "__main__":
    main()
