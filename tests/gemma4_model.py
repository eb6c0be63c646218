"""Tiny Gemma 4 text models for the tests, one per shape the family ships, with random weights
that make every part matter (norms, per-layer scalars, router scales away from their initial
ones), saved with the word tokenizer; transformers' own logits and greedy continuations hold the
engine to them.

- ``e2b``: the small models' shape (E2B/E4B): per-layer embeddings, the last layers reading the
  keys and values of earlier ones with a double-wide MLP, global layers of wider heads.
- ``dense``: the 31B's: global layers of fewer, wider heads whose keys are their values.
- ``moe``: the 26B-A4B's: as ``dense``, with experts beside every layer's dense MLP.
"""

from __future__ import annotations

import torch

from backends.test_torch_paged import VOCAB, save_word_tokenizer

WINDOW = 8
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=WINDOW,
            max_position_embeddings=512, tie_word_embeddings=True, initializer_range=0.2, bos_token_id=0,
            eos_token_id=1, pad_token_id=2, final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)
SHAPES: dict[str, dict] = {
    "e2b": dict(num_kv_shared_layers=3, use_double_wide_mlp=True, hidden_size_per_layer_input=8,
                vocab_size_per_layer_input=VOCAB, num_global_key_value_heads=1),
    "dense": dict(attention_k_eq_v=True, num_global_key_value_heads=1, hidden_size_per_layer_input=0),
    "moe": dict(attention_k_eq_v=True, num_global_key_value_heads=1, hidden_size_per_layer_input=0,
                enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32),
}
LOGIT_SPREAD = 8.0
MIN_MARGIN = 1e-3


def _stir(model: torch.nn.Module, seed: int) -> None:
    """Norm weights, per-layer scalars and the router's scales drawn away from their initial values."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("layer_scalar") or name.endswith("per_expert_scale") or name.endswith("router.scale"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + 1.0)


def write_gemma4(name: str, path: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Save the tiny model ``name`` (``SHAPES``) to ``path`` in ``dtype`` (bf16: as the Hub's
    checkpoints are); returns transformers' model over the saved directory in float32, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gemma4_text", **TEXT, **SHAPES[name]),
                                             dtype=torch.float32)
    _stir(model, seed)
    ids = torch.randint(3, VOCAB, (1, 64), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        spread = float(model(ids).logits.std())
        model.get_output_embeddings().weight.mul_(min(LOGIT_SPREAD / spread, 4.0))
    model.to(dtype).save_pretrained(path)
    save_word_tokenizer(path)
    served = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    served.generation_config.eos_token_id = None  # the engine runs with ignore_eos: neither stops early
    return served


VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              head_dim=16)


def write_gemma4_checkpoint(path: str, seed: int = 0) -> torch.nn.Module:
    """A whole Gemma 4 checkpoint (``gemma4``: a vision tower beside the ``e2b`` language model, as
    the Hub's are) saved to ``path``; returns transformers' model of it, in eval mode."""
    from transformers import AutoConfig, Gemma4ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model("gemma4", text_config=dict(TEXT, **SHAPES["e2b"]), vision_config=VISION,
                               audio_config=None)
    model = Gemma4ForConditionalGeneration(cfg).eval()
    _stir(model, seed)
    model.save_pretrained(path)
    save_word_tokenizer(path)
    return model
