"""The fused forward's mixture-of-experts feed-forward (``moe.py``) against transformers' own
sparse blocks on the same weights: the router picks the same experts with the same weights
(Qwen3-MoE renormalised by ``norm_topk_prob`` and without it, Mixtral always), and the block's
output matches, with the experts as views of the model's tensors and packed for the native
kernel (after which the model's 3-D expert tensors are freed)."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from llmserve.plugins.backends.torch.fused import FusedDecoder

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
MODELS = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48, norm_topk_prob=True),
    "qwen3_moe-unnormalised": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48,
                                   norm_topk_prob=False),
    "mixtral": dict(num_local_experts=6, num_experts_per_tok=2, sliding_window=None),
}


def tiny(name: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(len(name))
    cfg = AutoConfig.for_model(name.split("-")[0], **BASE, **MODELS[name])
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # routers spread enough that no two experts tie for a place
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("pack", [False, True], ids=["views", "packed"])
def test_routing_and_output_equal_transformers(name: str, pack: bool) -> None:
    model = tiny(name)
    reference = copy.deepcopy(model)
    fused = FusedDecoder.build(model, pack=pack)
    assert fused is not None
    x = torch.randn(37, BASE["hidden_size"], generator=torch.Generator().manual_seed(1))
    for lay, dec in zip(fused.layers, reference.model.layers):
        moe, block = lay.moe, dec.mlp
        assert moe is not None and moe.num_experts == MODELS[name].get("num_experts", 6)
        with torch.no_grad():
            _, want_w, want_i = block.gate(x)
            want = block(x[None])[0]
        got_i, got_w = moe.route(x)
        assert torch.equal(got_i, want_i), f"{name}: other experts picked"
        torch.testing.assert_close(got_w, want_w.to(got_w.dtype), rtol=1e-5, atol=1e-6)  # packed: another sum order
        if "unnormalised" not in name:
            torch.testing.assert_close(got_w.sum(-1), torch.ones(len(x)), rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            got = moe(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    experts = model.model.layers[0].mlp.experts
    if pack:  # the packed copies replaced the model's 3-D tensors
        assert experts.gate_up_proj.numel() == 0 and experts.down_proj.numel() == 0
    else:  # views of them: nothing stored twice
        assert fused.layers[0].moe.gate_up[3].weight.data_ptr() == experts.gate_up_proj[3].data_ptr()


def test_rows_no_expert_picked_cost_nothing() -> None:
    """Each expert runs only over the rows routed to it: a step whose rows all pick the same two
    experts calls no other expert."""
    model = tiny("qwen3_moe")
    fused = FusedDecoder.build(model)
    moe = fused.layers[0].moe
    x = torch.randn(1, BASE["hidden_size"]).repeat(9, 1)
    calls = []

    def counted(e: int, product):
        def run(t: torch.Tensor) -> torch.Tensor:
            calls.append(e)
            return product(t)
        return run

    moe.gate_up = [counted(e, product) for e, product in enumerate(moe.gate_up)]
    moe(x)
    picked = set(moe.route(x[:1])[0][0].tolist())
    assert sorted(calls) == sorted(picked) and len(picked) == 3
    assert int(moe.hits.sum()) == 9 * 3 and int((moe.hits > 0).sum()) == 3
