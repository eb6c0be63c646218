"""Tiny hybrid models for the tests: Qwen3.5 (dense and MoE) and Qwen3-Next shapes with random
weights (three Gated DeltaNet layers, then one gated full-attention layer), saved with the word
tokenizer, and transformers' own logits and greedy continuations to hold the engine to.

The weights are drawn so the recurrent layers matter: decay rates from fast to slow, norms away
from one, and an output embedding scaled so the logits spread widely (every greedy step of the
reference has a clear winner, so rounding never decides a token).
"""

from __future__ import annotations

import torch

from backends.test_torch_paged import VOCAB, save_word_tokenizer

TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, initializer_range=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=2)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
VISION = dict(depth=1, hidden_size=32, num_heads=2, out_hidden_size=64, intermediate_size=64)
# name -> (model_type, config beyond TEXT); "qwen3_5" is a whole Qwen3.5 checkpoint (vision tower
# and all, as the Hub's are), of which the engine serves the language model.
SHAPES: dict[str, tuple[str, dict]] = {
    "qwen3_5_text": ("qwen3_5_text", {}),
    "qwen3_5_moe_text": ("qwen3_5_moe_text", MOE),
    "qwen3_next": ("qwen3_next", MOE),
    "qwen3_5": ("qwen3_5", {}),
}
LOGIT_SPREAD = 8.0
MIN_MARGIN = 1e-3


def _stir(model: torch.nn.Module) -> None:
    """Decays from fast to slow and norms away from one: the state carries far back and
    each layer's parts all matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-4.0, 1.0)
            elif name.endswith("dt_bias"):
                p.normal_(0.0, 1.0)
            elif "norm" in name and name.endswith("weight"):
                p.normal_(0.0 if "linear_attn" not in name else 1.0, 0.3)


def write_hybrid(name: str, path: str, seed: int = 0) -> torch.nn.Module:
    """Save the tiny model ``name`` (``SHAPES``) to ``path``; returns the language model as
    transformers serves it (``AutoModelForCausalLM`` over the saved directory), in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

    arch, extra = SHAPES[name]
    torch.manual_seed(seed)
    if arch == "qwen3_5":
        cfg = AutoConfig.for_model(arch, text_config=dict(TEXT, **extra), vision_config=VISION)
        model: torch.nn.Module = Qwen3_5ForConditionalGeneration(cfg)
        lm = model.model.language_model
        head = model.lm_head
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **TEXT, **extra), dtype=torch.float32)
        lm, head = model.model, model.lm_head
    _stir(model)
    ids = torch.randint(3, VOCAB, (1, 64), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        spread = float(head(lm(ids).last_hidden_state).std())
        head.weight.mul_(LOGIT_SPREAD / spread)
    model.save_pretrained(path)
    save_word_tokenizer(path)
    served = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    served.generation_config.eos_token_id = None  # the engine runs with ignore_eos: neither stops early
    return served


def reference_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' logits ``[len(ids), vocab]`` of one pass over ``ids``."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def reference_generate(model: torch.nn.Module, ids: list[int], max_new: int) -> list[int]:
    """transformers' greedy continuation of ``ids`` (its own recurrent cache), checked free of
    near ties."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new, pad_token_id=2,
                             output_scores=True, return_dict_in_generate=True)
    margins = [float(top[0] - top[1]) for top in (s[0].topk(2).values for s in out.scores)]
    assert min(margins) >= MIN_MARGIN, f"a near tie in the reference ({min(margins):.1e}): change the seed"
    return out.sequences[0, len(ids):].tolist()
