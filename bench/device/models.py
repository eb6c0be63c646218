"""Random-weight models for the device run, from the embedded model's config and tokenizer
(carried in ``TOK``): the embedded shape in fp32 (greedy equality) and Llama-3.2-1B's shape in
bf16 (speed). Built on the GPU and saved once; speed does not depend on the weights' values.

    python bench/device/models.py TOK OUT_DIR
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM

SHAPES = {
    "m-small": ("float32", {}),
    "m-1b": ("bfloat16", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                              num_key_value_heads=8, head_dim=64, rope_theta=500000.0, tie_word_embeddings=True)),
}


def main() -> None:
    tok, out = sys.argv[1], sys.argv[2]
    for name, (dtype, over) in SHAPES.items():
        path = os.path.join(out, name)
        if os.path.exists(os.path.join(path, "model.safetensors")):
            continue
        os.makedirs(path, exist_ok=True)
        for f in os.listdir(tok):
            shutil.copy(os.path.join(tok, f), path)
        with open(os.path.join(tok, "config.json")) as fh:
            cfg = json.load(fh)
        cfg.update(over, dtype=dtype)
        with open(os.path.join(path, "config.json"), "w") as fh:
            json.dump(cfg, fh)
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=getattr(torch, dtype))
        model.save_pretrained(path)
        print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e9:.3f} B parameters, {dtype}")


if __name__ == "__main__":
    main()
