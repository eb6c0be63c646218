"""Models whose attention the paged kernel cannot run are refused at load, not mid-request."""

import pytest

from llmserve.config import ModelConfig

torch = pytest.importorskip("torch")


def test_softcapping_model_is_refused_at_load(tmp_path):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from llmserve.errors import ConfigError
    from llmserve.plugins.backends.torch.loader import load_model

    cfg = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, attn_logit_softcapping=50.0)
    Gemma2ForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="uses attention softcapping, which"):
        load_model(ModelConfig(model=str(tmp_path), dtype="float32", device="cpu"))
