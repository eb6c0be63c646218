"""The torch backend's options decide its execution plan, which it logs as one line at start-up."""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from llmserve.config import ServerConfig
from llmserve.engine.backend import KVCacheSpec, StepItem
from llmserve.errors import ConfigError
from llmserve.plugins.backends.torch import bf16_rows
from llmserve.plugins.backends.torch.native import build
from llmserve.plugins.backends.torch.options import TorchOptions
from llmserve.plugins.backends.torch.runner import TorchBackend
from test_torch_paged import build_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    build_tiny_model(path)
    return path


@pytest.fixture()
def threads():
    """Options may set torch's thread count, which is process-wide: put it back afterwards."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def plan_lines(tiny_dir: str, options: TorchOptions | None, caplog: pytest.LogCaptureFixture) -> list[str]:
    backend = TorchBackend(ServerConfig(model=tiny_dir, dtype="float32", device="cpu", max_model_len=None), options)
    with caplog.at_level(logging.INFO, logger="llmserve.backend.torch"):
        backend.load()
        backend.init_kv_cache(KVCacheSpec(block_size=4, num_blocks=16))
    backend.close()
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("execution plan:")]


PLANS = [
    (TorchOptions(threads=1),
     "device=cpu dtype=float32 kv_dtype=float32 "
     "threads=1 forward=fused decode_attention=native prefill_attention=native linears=packed elementwise=native "
     "native_step=on panels=f32:9,q4:0,q8:0,bf16:0"),
    (TorchOptions(threads=1, native_step=False, compact_weights=False),
     "device=cpu dtype=float32 kv_dtype=float32 "
     "threads=1 forward=fused decode_attention=native prefill_attention=native linears=packed elementwise=native "
     "native_step=off panels=f32:9,q4:0,q8:0,bf16:0"),
    (TorchOptions(threads=2, cpu_kernels=False),
     "device=cpu dtype=float32 kv_dtype=float32 "
     "threads=2 forward=fused decode_attention=matmul prefill_attention=sdpa linears=torch elementwise=torch "
     "native_step=off panels=f32:0,q4:0,q8:0,bf16:0"),
    (TorchOptions(threads=1, fused_forward=False, cpu_kernels=False, cpu_matmul_decode=False),
     "device=cpu dtype=float32 kv_dtype=float32 "
     "threads=1 forward=transformers decode_attention=sdpa prefill_attention=sdpa linears=torch elementwise=torch "
     "native_step=off panels=f32:0,q4:0,q8:0,bf16:0"),
    (TorchOptions(threads=1, fused_forward=False),  # lm_head is still packed
     "device=cpu dtype=float32 kv_dtype=float32 threads=1 forward=transformers decode_attention=native "
     "prefill_attention=native linears=packed "
     "elementwise=native native_step=off panels=f32:1,q4:0,q8:0,bf16:0"),
]


@pytest.mark.parametrize("options,plan", PLANS, ids=["all-native", "layer-loop", "torch-kernels", "transformers",
                                                      "transformers-packed-head"])
def test_the_plan_is_one_log_line(tiny_dir: str, caplog, threads, options: TorchOptions, plan: str) -> None:
    """The tiny model: 2 layers x 4 projections + lm_head; its random weights fit no code panel."""
    assert plan_lines(tiny_dir, options, caplog) == [f"execution plan: {plan}"]


def assert_transformers_logits(backend: TorchBackend, path: str) -> None:
    """The backend's logits of a 20-token prompt equal transformers' fp32 forward on ``path``'s
    weights (then the backend is closed)."""
    from transformers import AutoModelForCausalLM

    ids = list(range(5, 25))
    got = backend.forward_logits([StepItem(seq_id=0, token_ids=ids, start_pos=0, block_table=list(range(5)))])[0]
    backend.close()
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model saved as a bf16 checkpoint."""
    from transformers import AutoModelForCausalLM

    path = str(tmp_path_factory.mktemp("tiny-bf16"))
    build_tiny_model(path)
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(path)
    return path


@pytest.mark.parametrize("dtype,options,panels", [
    ("float32", TorchOptions(threads=1), "native_step=on panels=f32:0,q4:0,q8:0,bf16:9"),
    ("auto", TorchOptions(threads=1), "native_step=on panels=f32:0,q4:0,q8:0,bf16:9"),
    ("float32", TorchOptions(threads=1, fused_forward=False), "native_step=off panels=f32:0,q4:0,q8:0,bf16:1"),
    ("float32", TorchOptions(threads=1, cpu_kernels=False), "native_step=off panels=f32:0,q4:0,q8:0,bf16:0"),
], ids=["float32", "auto", "transformers-forward", "torch-kernels"])
def test_a_bf16_checkpoint_computes_in_float32_on_bf16_rows(bf16_dir, threads, dtype, options, panels) -> None:
    """A bf16 checkpoint on the CPU (``auto`` or ``float32``) loads in bf16 and computes in
    float32: every projection and the head the kernels take stay bf16 rows (half of fp32 panels'
    bytes; no float32 copy of them is made), what they do not take is widened, and the logits are
    transformers' own on the same weights whichever path runs."""

    backend = TorchBackend(ServerConfig(model=bf16_dir, dtype=dtype, device="cpu"), options)
    backend.load()
    backend.init_kv_cache(KVCacheSpec(block_size=4, num_blocks=16))
    plan = backend.plan()
    assert "dtype=float32" in plan and plan.endswith(panels), plan
    # The linear weights still held: float32 (widened, or loaded so), or the packed head's bf16
    # weight; where the kernels took every projection, the projections' own are gone.
    kept = [m.weight for m in backend.loaded.model.modules() if isinstance(m, torch.nn.Linear) and m.weight.numel()]
    head = backend._lm_head.weight if backend._packed_head is not None else None
    assert all(w.dtype == torch.float32 or w is head for w in kept)
    assert len(kept) <= 1 or not plan.endswith("bf16:9")
    # With the fused forward the embedding is looked up in bf16 rows of its own too.
    fused = backend._fused is not None and options.cpu_kernels
    assert isinstance(getattr(backend._fused, "embed", None), bf16_rows.Embedding) == fused
    assert_transformers_logits(backend, bf16_dir)


def test_a_tied_bf16_head_shares_the_embeddings_rows(tmp_path, threads) -> None:
    """Tied embeddings of a bf16 checkpoint: one copy of bf16 rows serves the lookup and the head."""
    from transformers import AutoModelForCausalLM

    path = str(tmp_path / "tied")
    build_tiny_model(path, tie_word_embeddings=True)
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(path)
    backend = TorchBackend(ServerConfig(model=path, dtype="float32", device="cpu"), TorchOptions(threads=1))
    backend.load()
    backend.init_kv_cache(KVCacheSpec(block_size=4, num_blocks=16))
    embed = backend._fused.embed
    assert isinstance(embed, bf16_rows.Embedding) and embed.tied
    assert backend._packed_head._parts[0] is embed.rows and backend._lm_head.weight.numel() == 0
    assert_transformers_logits(backend, path)


def test_a_bf16_moe_checkpoint_keeps_its_experts_as_bf16_rows(tmp_path, threads) -> None:
    """A bf16 Qwen3-MoE checkpoint: its experts' 3-D matrices stay bf16 until each expert becomes
    bf16 rows (no fp32 copy of them), and the logits are transformers' fp32 forward's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from test_torch_paged import VOCAB, save_word_tokenizer

    path = str(tmp_path / "moe-bf16")
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("qwen3_moe", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                               moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.2,
                               max_position_embeddings=256, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(path)
    save_word_tokenizer(path)
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    bf16_rows.widen_all_but_linears(loaded)  # what the load does before the fused forward packs
    mlp = loaded.model.layers[0].mlp
    assert (mlp.experts.gate_up_proj.dtype, mlp.experts.down_proj.dtype) == (torch.bfloat16, torch.bfloat16)
    assert (mlp.gate.weight.dtype, loaded.model.norm.weight.dtype) == (torch.float32, torch.float32)
    assert loaded.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    backend = TorchBackend(ServerConfig(model=path, dtype="float32", device="cpu"), TorchOptions(threads=1))
    backend.load()
    backend.init_kv_cache(KVCacheSpec(block_size=4, num_blocks=16))
    held = [p for p in backend.loaded.model.parameters() if p.numel()]
    assert all(p.dtype == torch.float32 for p in held), "an fp32 path holds bf16, or rows were not taken"
    moe = backend._fused.layers[0].moe
    assert {lin.format for lin in [*moe.gate_up, *moe.down]} == {"bf16"}
    assert_transformers_logits(backend, path)


def test_the_environment_sets_a_backend_built_without_options(tiny_dir: str, caplog, threads, monkeypatch,
                                                              tmp_path) -> None:
    """LLMSERVE_CPU_KERNELS=0 (and no options): torch everywhere, and no kernel is even built."""
    monkeypatch.setenv("LLMSERVE_CPU_KERNELS", "0")
    monkeypatch.setenv("LLMSERVE_THREADS", "1")
    monkeypatch.setenv("LLMSERVE_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setattr(build, "_loaded", {})
    assert plan_lines(tiny_dir, None, caplog) == [
        "execution plan: device=cpu dtype=float32 kv_dtype=float32 "
        "threads=1 forward=fused decode_attention=matmul prefill_attention=sdpa linears=torch "
        "elementwise=torch native_step=off panels=f32:0,q4:0,q8:0,bf16:0"]
    assert build._loaded == {} and not (tmp_path / "kernels").exists()


def test_given_values_win_over_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("LLMSERVE_FUSED_FORWARD", "0")
    monkeypatch.setenv("LLMSERVE_NATIVE_STEP", "off")
    options = TorchOptions.from_environ(fused_forward=True)
    assert (options.fused_forward, options.native_step, options.cpu_kernels) == (True, False, True)
    monkeypatch.setenv("LLMSERVE_COMPACT_WEIGHTS", "sometimes")
    with pytest.raises(ConfigError, match="invalid options for 'torch': compact-weights: .*LLMSERVE_COMPACT_WEIGHTS"):
        TorchOptions.from_environ()
