"""Fixtures for the tensor-parallel tests: tiny random Llamas with a chosen head layout."""

from __future__ import annotations

import os

import pytest

from llmserve.config import ServerConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")
VOCAB = 250  # not a multiple of 2 or 3: the vocabulary slices are padded


def build_tiny(path: str, heads: int, kv_heads: int) -> str:
    """A 2-layer random Llama (head size 16) with a word-level tokenizer, saved at ``path``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16 * heads, intermediate_size=100, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                      initializer_range=0.2, tie_word_embeddings=True, eos_token_id=1, bos_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", bos_token="t0").save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_6_3(tmp_path_factory: pytest.TempPathFactory) -> str:
    """6 heads in 3 KV heads: splits over 2 ranks (unevenly) and over 3."""
    return build_tiny(str(tmp_path_factory.mktemp("tiny-6-3")), 6, 3)


@pytest.fixture(scope="session")
def tiny_4_2(tmp_path_factory: pytest.TempPathFactory) -> str:
    """4 heads in 2 KV heads: no split over 3 ranks."""
    return build_tiny(str(tmp_path_factory.mktemp("tiny-4-2")), 4, 2)


def config(model: str | None, tp: int, **more: object) -> ServerConfig:
    return ServerConfig(model=model, dtype="float32", device="cpu", max_model_len=None,
                           tensor_parallel_size=tp, log_level="warning", **more)
