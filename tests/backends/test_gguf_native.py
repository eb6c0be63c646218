"""GGUF models served in their own quantization (``gguf_model.py``) against transformers' forward
on the dequantized weights, on tiny generated GGUFs of every served type; start-up, refusal of
unserved types, and (slow) the real SmolLM2 re-quantized, greedy, and a server's memory."""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from llmserve.config import ServerConfig
from llmserve.engine.backend import KVCacheSpec, StepItem
from llmserve.errors import ConfigError
from llmserve.plugins.backends.torch.loader import hf_directory
from llmserve.plugins.backends.torch.options import TorchOptions
from llmserve.plugins.backends.torch.runner import TorchBackend
from llmserve.plugins.backends.torch.native import gguf_ops

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import gguf_writer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
BS = 16
# Every served type, three to a model: the first for most matrices, the others for K, the
# MLP's up and the head (second) and V, down and the embedding (third), so each type runs
# inside a fused projection, alone, and as the embedding or the head.
TYPE_GROUPS = [("F32", "F16", "BF16"), ("Q8_0", "Q4_0", "Q4_1"), ("Q5_0", "Q5_1", "Q8_0"), ("Q4_K", "Q5_K", "Q6_K"),
               ("Q3_K", "Q2_K", "IQ4_XS"), ("IQ4_NL", "MXFP4", "Q6_K")]
# The kernels compute in fp32 like the reference, in another summation order: the largest
# logit difference stays under this fraction of the reference's largest |logit|.
MAX_REL_ERR = 1e-3
# gguf_bf16_matmul: a prefill (more than 32 rows) computes to about 2^-16 per product; single
# decode steps round the activations of Q4_K / Q6_K products to bf16 (8 significant bits). The
# random K-quant blocks of the generated models amplify any error (the fp32 path's summation
# order alone moves their logits by up to 2e-4), hence the bound.
BF16_MAX_REL_ERR, BF16_MIN_AGREE = 0.1, 0.99
# Decode batches (5 to 32 rows) round each weight to bf16. A random tiny model has near ties
# (and its random K-quant blocks amplify errors), so a few positions pick another top token.
BATCH_MAX_REL_ERR, BATCH_MIN_AGREE = 0.2, 0.97
# gguf_decode_activations int8: decode steps round each 32 activations to int8 (about 0.4% of their largest);
# against the exact kernels, logits move by about 1% of the largest (up to ~10% where the random
# K-quant blocks amplify it), and near ties of the random tiny model pick another top token.
INT8_MAX_REL_ERR, INT8_MIN_AGREE = 0.2, 0.9


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One metadata cache for the module's tiny files: files that differ only in their tensors'
    types share an entry (the cache key leaves the types out), and the tokenizer, the same in
    every file, is converted once."""
    return str(tmp_path_factory.mktemp("shared-cache"))


def make_backend(path: str, cache: str, num_blocks: int = 32, **options: object) -> TorchBackend:
    """A backend serving ``path`` natively on the exact kernels, unless ``options`` name the
    decode steps' activations (the default, auto, takes int8 for the K-quants these tests write)."""
    options.setdefault("gguf_decode_activations", "fp32")
    backend = TorchBackend(ServerConfig(model=path, dtype="float32", device="cpu", max_model_len=None,
                                        cache_dir=cache), TorchOptions(**options))
    backend.info = backend.load()
    backend.init_kv_cache(KVCacheSpec(block_size=BS, num_blocks=num_blocks))
    return backend


def native_logits(backend: TorchBackend, ids: list[int], prefill: int) -> torch.Tensor:
    """Logits at every position: ``prefill`` tokens in one step, then one decode step per token
    (the one-call native step)."""
    table = list(range(-(-len(ids) // BS)))
    out = backend.forward_logits([StepItem(seq_id=1, token_ids=ids[:prefill], start_pos=0, block_table=table)])
    rows = [out[0]]
    for p in range(prefill, len(ids)):
        rows += backend.forward_logits([StepItem(seq_id=1, token_ids=[ids[p]], start_pos=p, block_table=table)])
    return torch.cat(rows)


def batched_logits(backend: TorchBackend, seqs: list[list[int]], prefill: int) -> list[torch.Tensor]:
    """Logits of the positions after ``prefill`` of each sequence, decoded all at once: one step
    per position, every sequence in it."""
    blocks = -(-max(map(len, seqs)) // BS)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(len(seqs))]
    for i, ids in enumerate(seqs):
        backend.forward_logits([StepItem(seq_id=i + 1, token_ids=ids[:prefill], start_pos=0, block_table=tables[i])])
    rows: list[list[torch.Tensor]] = [[] for _ in seqs]
    for p in range(prefill, len(seqs[0])):
        out = backend.forward_logits([StepItem(seq_id=i + 1, token_ids=[ids[p]], start_pos=p, block_table=tables[i])
                                      for i, ids in enumerate(seqs)])
        for i, logits in enumerate(out):
            rows[i].append(logits)
    return [torch.cat(r) for r in rows]


def reference_logits(path: str, *seqs: list[int], rope_scaling: dict | None = None) -> torch.Tensor:
    """transformers' forward on the weights dequantized from the same file: [positions, vocab]
    for one sequence, [sequences, positions, vocab] for several of one length (one load)."""
    model = gguf_writer.reference_model(path, rope_scaling)
    with torch.no_grad():
        logits = model(torch.tensor(list(seqs))).logits.float()
    return logits[0] if len(seqs) == 1 else logits


def compare(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    err = (got - want).abs().max().item() / want.abs().max().item()
    return agree, err


def sequence(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 49152, (n,), generator=g).tolist()


def group_overrides(layers: int, second: str, third: str) -> dict[str, str]:
    out = {"output.weight": second, "token_embd.weight": third}
    for i in range(layers):
        out |= {f"blk.{i}.attn_k.weight": second, f"blk.{i}.ffn_up.weight": second,
                f"blk.{i}.attn_v.weight": third, f"blk.{i}.ffn_down.weight": third}
    return out


@pytest.mark.parametrize("types", TYPE_GROUPS, ids="-".join)
def test_llama_logits_match_transformers_on_the_dequantized_weights(types: tuple[str, ...], tmp_path,
                                                                     shared_cache) -> None:
    path = str(tmp_path / f"tiny-llama.{types[0]}.gguf")
    gguf_writer.write_tiny_gguf(path, "llama", types[0], overrides=group_overrides(2, *types[1:]))
    ids = sequence(40)
    backend = make_backend(path, shared_cache)
    plan = backend.plan()
    assert f"weights=gguf:{','.join(sorted({t.lower() for t in types}))}" in plan and "native_step=on" in plan, plan
    assert backend.info.quantization.startswith("quantized as in the file: ")
    agree, err = compare(native_logits(backend, ids, prefill=24), reference_logits(path, ids))
    assert agree >= 0.99 and err < MAX_REL_ERR, (agree, err)


@pytest.mark.parametrize("types", [("Q8_0", "Q4_0", "Q4_1"), ("Q4_K", "Q4_K", "Q6_K")], ids="-".join)
def test_bf16_matmul_logits_stay_near_transformers(types: tuple[str, ...], tmp_path, shared_cache) -> None:
    """``gguf_bf16_matmul`` against transformers' fp32 forward (the Q4_K_M mix of Q4_K and Q6_K;
    the legacy types): a 200-token prefill (tiles, weights and activations split) and 40
    single-token decode steps (the K-quants' bf16 dot products) pick the same top token at
    BF16_MIN_AGREE of the positions, the largest logit difference under BF16_MAX_REL_ERR of the
    largest logit; then eight sequences decoded together (tiles, weights rounded to bf16) at
    BATCH_MIN_AGREE, under BATCH_MAX_REL_ERR."""
    from llmserve.plugins.backends.torch.native import gguf_ops

    if not gguf_ops.amx_available():
        pytest.skip("this CPU has no AMX-BF16 tiles")
    path = str(tmp_path / f"tiny-llama.{types[0]}.gguf")
    gguf_writer.write_tiny_gguf(path, "llama", types[0], overrides=group_overrides(2, *types[1:]))
    ids = sequence(240, seed=2)
    backend = make_backend(path, shared_cache, num_blocks=40, gguf_bf16_matmul=True)
    assert "gguf_matmul=bf16-amx" in backend.plan()
    agree, err = compare(native_logits(backend, ids, prefill=200), reference_logits(path, ids))
    assert agree >= BF16_MIN_AGREE and err < BF16_MAX_REL_ERR, (agree, err)
    seqs = [sequence(40, seed=10 + i) for i in range(8)]
    got = batched_logits(backend, seqs, prefill=10)
    results = [compare(g, want[10:]) for g, want in zip(got, reference_logits(path, *seqs))]
    agree, err = sum(a for a, _ in results) / len(results), max(e for _, e in results)
    assert agree >= BATCH_MIN_AGREE and err < BATCH_MAX_REL_ERR, (agree, err)


@pytest.mark.parametrize("mode", ["auto", "int8"])
def test_decode_steps_take_int8_activations(mode: str, tmp_path, shared_cache) -> None:
    """``gguf_decode_activations``: decode steps of Q4_K and Q6_K weights (auto, the default) and
    Q8_0 ones too (int8) multiply int8-quantized activations, the one-call native step included;
    a prefill of more rows than ``int8_rows()`` stays exact bit for bit; auto leaves the Q8_0 head
    exact."""
    path = str(tmp_path / "tiny-q4km.gguf")
    gguf_writer.write_tiny_gguf(path, "llama", "Q4_K", overrides={
        "blk.0.attn_v.weight": "Q6_K", "blk.1.ffn_down.weight": "Q6_K", "output.weight": "Q8_0"})
    long = gguf_ops.int8_rows() + 1
    ids = sequence(long + 20, seed=6)
    fast = make_backend(path, shared_cache, gguf_decode_activations=mode)
    exact = make_backend(path, shared_cache)
    assert "gguf_decode=int8" in fast.plan() and "native_step=on" in fast.plan()
    assert "gguf_decode" not in exact.plan()
    assert TorchOptions().gguf_decode_activations == "auto"
    # the Q8_0 output head: exact under auto, int8 when asked; the Q4_K/Q6_K layers int8 either way
    assert fast._gguf.head.activations == ("int8" if mode == "int8" else "fp32")
    assert {lin.activations for layer in fast._gguf.layers for lin in layer.values()} == {"int8"}
    got, want = native_logits(fast, ids, prefill=long), native_logits(exact, ids, prefill=long)
    assert torch.equal(got[0], want[0])  # the prefill step: exact kernels
    agree, err = compare(got[1:], want[1:])
    assert agree >= INT8_MIN_AGREE and 0 < err < INT8_MAX_REL_ERR, (agree, err)


def test_qwen2_with_biases_and_a_tied_head(tmp_path, shared_cache) -> None:
    path = str(tmp_path / "tiny-qwen2.gguf")
    gguf_writer.write_tiny_gguf(path, "qwen2", "Q4_K", tied=True, overrides={
        "blk.0.attn_v.weight": "Q6_K", "blk.1.ffn_down.weight": "Q6_K", "token_embd.weight": "Q8_0"})
    ids = sequence(40, seed=1)
    backend = make_backend(path, shared_cache)
    assert "weights=gguf:q4_k,q6_k,q8_0" in backend.plan()
    agree, err = compare(native_logits(backend, ids, prefill=20), reference_logits(path, ids))
    assert agree >= 0.99 and err < MAX_REL_ERR, (agree, err)


def test_qwen3_with_head_norms_and_a_head_size_of_its_own(tmp_path, shared_cache) -> None:
    """Qwen3: RMSNorm of every query and key head before RoPE, and 8 heads of 64 on a hidden size
    of 256 (the head size read from ``attention.key_length``), in prefill and the native step;
    and the same file through the fp32 conversion (CUDA, bf16, ``--no-torch-gguf-native``), whose
    config transformers alone would give its class's default head size (128)."""
    path = str(tmp_path / "tiny-qwen3.gguf")
    gguf_writer.write_tiny_gguf(path, "qwen3", "Q4_K", heads=8, kv_heads=4, head_dim=64, overrides={
        "blk.0.attn_v.weight": "Q6_K", "blk.1.attn_output.weight": "Q8_0", "output.weight": "Q6_K"})
    ids = sequence(40, seed=2)
    backend = make_backend(path, shared_cache)
    plan = backend.plan()
    assert "weights=gguf:q4_k,q6_k,q8_0" in plan and "native_step=on" in plan, plan
    assert backend._fused.head_dim == 64 and backend._fused.layers[0].q_norm is not None
    want = reference_logits(path, ids)
    agree, err = compare(native_logits(backend, ids, prefill=20), want)
    assert agree >= 0.99 and err < MAX_REL_ERR, (agree, err)
    from transformers import AutoModelForCausalLM

    converted = AutoModelForCausalLM.from_pretrained(hf_directory(path, shared_cache)).float().eval()
    assert converted.config.head_dim == 64
    with torch.no_grad():
        agree, err = compare(converted(torch.tensor([ids])).logits[0], want)
    assert agree >= 0.99 and err < MAX_REL_ERR, (agree, err)


def test_gemma3_with_sandwich_norms_gelu_and_local_and_global_layers(tmp_path, shared_cache) -> None:
    """Gemma 3 as llama.cpp writes it: norms stored as 1 + weight, four a layer, q/k norms, GELU,
    scaled embeddings, five sliding-window layers (window 8, RoPE base 10000) and one global
    (base 1e6), a tied head; through a 40-token prompt that crosses the window."""
    path = str(tmp_path / "tiny-gemma3.gguf")
    gguf_writer.write_tiny_gguf(path, "gemma3", "Q4_K", layers=6, tied=True, overrides={
        "blk.0.attn_v.weight": "Q6_K", "blk.5.ffn_down.weight": "Q8_0", "token_embd.weight": "Q8_0"})
    ids = sequence(40, seed=3)
    backend = make_backend(path, shared_cache)
    plan = backend.plan()
    assert "weights=gguf:q4_k,q6_k,q8_0" in plan and "native_step=on" in plan, plan
    fused = backend._fused
    assert [lay.window for lay in fused.layers] == [gguf_writer.GEMMA3_WINDOW] * 5 + [None]
    assert fused.rope_kinds == ["sliding_attention", "full_attention"]
    agree, err = compare(native_logits(backend, ids, prefill=12), reference_logits(path, ids))
    assert agree >= 0.99 and err < MAX_REL_ERR, (agree, err)


def test_qwen3_moe_routes_each_token_to_its_experts(tmp_path, shared_cache) -> None:
    """Qwen3-MoE as llama.cpp writes it: a router and three 3-D expert tensors a layer (8 experts,
    2 a token, their size from ``expert_feed_forward_length``), every expert a slice of the
    mapping; prefill and decode steps against transformers' forward."""
    path = str(tmp_path / "tiny-qwen3moe.gguf")
    # Types quantized from the model's own weights (random K-quant blocks would send every token's
    # hidden state the same way, and so every token to the same experts).
    gguf_writer.write_tiny_gguf(path, "qwen3moe", "Q8_0", overrides={
        "blk.0.ffn_down_exps.weight": "Q4_0", "blk.1.ffn_gate_inp.weight": "F32", "output.weight": "Q4_1"})
    ids = sequence(40, seed=4)
    backend = make_backend(path, shared_cache)
    assert "weights=gguf:f32,q4_0,q4_1,q8_0" in backend.plan()
    moe = backend._fused.layers[0].moe
    assert moe is not None and moe.num_experts == 8 and moe.top_k == 2 and moe.normalize
    agree, err = compare(native_logits(backend, ids, prefill=20), reference_logits(path, ids))
    assert agree >= 0.99 and err < MAX_REL_ERR, (agree, err)
    # Every token routed to two experts in every layer, and the routers spread them over more than two.
    routed = backend._fused.layers[1].moe.hits
    assert int(moe.hits.sum()) == int(routed.sum()) == 2 * len(ids) and int((routed > 0).sum()) > 2


def test_gpt_oss_with_sinks_biased_experts_and_alternating_windows(tmp_path, shared_cache) -> None:
    """gpt-oss as llama.cpp writes it: MXFP4 experts (gate and up apart, biases per expert), a
    biased router taking the top two logits before its softmax, clamped SwiGLU, biased
    attention with one sink logit per head, a window of 8 on even layers, YaRN; against
    transformers' forward over a 40-token prompt (prefill and decode steps)."""
    path = str(tmp_path / "tiny-gpt-oss.gguf")
    experts = {f"blk.{i}.ffn_{p}_exps.weight": "MXFP4" for i in range(2) for p in ("gate", "up", "down")}
    gguf_writer.write_tiny_gguf(path, "gpt-oss", "Q8_0", overrides=experts)
    ids = sequence(40, seed=5)
    backend = make_backend(path, shared_cache)
    assert "weights=gguf:mxfp4,q8_0" in backend.plan()
    fused = backend._fused
    assert [lay.window for lay in fused.layers] == [gguf_writer.GPT_OSS_WINDOW, None]
    assert all(lay.sinks is not None and lay.sinks.shape == (4,) for lay in fused.layers)
    moe = fused.layers[0].moe
    assert moe.num_experts == 8 and moe.top_k == 2 and not moe.softmax_first
    assert backend._fused.rotary.rope_type == "yarn"
    agree, err = compare(native_logits(backend, ids, prefill=20), reference_logits(path, ids))
    assert agree >= 0.99 and err < MAX_REL_ERR, (agree, err)
    assert int((fused.layers[1].moe.hits > 0).sum()) > 2  # the routers spread the tokens
    with pytest.raises(ConfigError, match=r"^tiny-gpt-oss\.gguf is a gpt-oss GGUF, which transformers' GGUF"):
        hf_directory(path, shared_cache)  # the conversion path: transformers misreads its metadata


def test_an_expert_count_that_does_not_match_is_refused(tmp_path, shared_cache) -> None:
    import numpy as np

    path = str(tmp_path / "bad-moe.gguf")
    wrong = np.zeros((6, 256, 256), np.float32)  # 6 experts where the metadata says 8
    gguf_writer.write_tiny_gguf(path, "qwen3moe", "Q8_0", replace={"blk.1.ffn_up_exps.weight": wrong})
    with pytest.raises(ConfigError, match=r"blk\.1\.ffn_up_exps\.weight has shape \[256, 256, 6\].*8 experts"):
        make_backend(path, shared_cache)


def test_llama3_rope_scaling_from_the_rope_freqs_tensor(tmp_path, shared_cache) -> None:
    """Llama 3.1+ files carry their RoPE scaling only as ``rope_freqs.weight``: served as
    transformers serves the config's llama3 scaling. The original context is set short so most
    frequencies are scaled within the prompt (with the file's divisors ignored, the logits part)."""
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)
    path = str(tmp_path / "llama31.gguf")
    gguf_writer.write_tiny_gguf(path, "llama", "Q8_0", llama3_rope=scaling)
    ids = sequence(40, seed=5)
    backend = make_backend(path, shared_cache)
    got = native_logits(backend, ids, prefill=24)
    agree, err = compare(got, reference_logits(path, ids, rope_scaling=scaling))
    assert agree >= 0.99 and err < MAX_REL_ERR, (agree, err)
    _, unscaled_err = compare(got, reference_logits(path, ids))
    assert unscaled_err > 20 * MAX_REL_ERR, "the scaling made no difference: the test would not see it missing"
    # transformers' conversion would drop the divisors: that path refuses the file.
    with pytest.raises(ConfigError, match=r"^llama31\.gguf stores its RoPE scaling as the rope_freqs\.weight"):
        hf_directory(path, shared_cache)


def test_a_mixtral_style_llama_file_is_refused_in_one_line(tmp_path, shared_cache) -> None:
    path = str(tmp_path / "mixtral.gguf")
    gguf_writer.write_tiny_gguf(path, "llama", "Q8_0", layers=1, uint_fields={"llama.expert_count": 8})
    with pytest.raises(ConfigError, match="Mixtral-style llama with 8 experts") as info:
        make_backend(path, shared_cache)
    assert "\n" not in str(info.value)


def test_a_projection_of_the_wrong_size_is_refused(tmp_path, shared_cache) -> None:
    import numpy as np

    path = str(tmp_path / "bad-up.gguf")
    gguf_writer.write_tiny_gguf(path, "llama", "Q8_0", layers=1, replace={"blk.0.ffn_up.weight":
                                                                         np.zeros((448, 256), np.float32)})
    with pytest.raises(ConfigError, match=r"blk\.0\.ffn_up\.weight is 448 x 256; .* has 512 x 256"):
        make_backend(path, shared_cache)


def test_a_qwen3_file_with_a_misshapen_head_norm_is_refused(tmp_path, shared_cache) -> None:
    import numpy as np

    path = str(tmp_path / "bad.gguf")
    gguf_writer.write_tiny_gguf(path, "qwen3", "Q8_0", replace={"blk.1.attn_k_norm.weight": np.ones(32, np.float32)})
    with pytest.raises(ConfigError, match=r"blk\.1\.attn_k_norm\.weight has 32 values .* has 64"):
        make_backend(path, shared_cache)


def test_start_writes_no_converted_copy_and_caches_the_metadata(tmp_path, caplog) -> None:
    path = str(tmp_path / "tiny.Q8_0.gguf")
    gguf_writer.write_tiny_gguf(path, "llama", "Q8_0")
    cache = tmp_path / "cache"
    first = make_backend(path, str(cache))
    assert not (cache / "converted").exists()
    root = cache / "gguf-metadata"
    entries = sorted(os.listdir(root))
    assert len(entries) == 2 and "tokenizers" in entries  # the file's entry, and its tokenizer's
    entry = next(e for e in entries if e != "tokenizers")
    assert os.path.isfile(root / entry / "tokenizer.json") and os.path.isfile(root / entry / "config.json")
    second = make_backend(path, str(cache))
    assert sorted(os.listdir(root)) == entries  # the same content: the same entry
    # Other metadata with the same tokenizer (another quantization's file_type, another size of
    # the family): an entry of its own, the tokenizer converted once.
    other = str(tmp_path / "other.gguf")
    gguf_writer.write_tiny_gguf(other, "llama", "Q8_0", layers=1)
    assert make_backend(other, str(cache)).info.vocab_size == 49152
    assert len(os.listdir(root)) == 3 and len(os.listdir(root / "tokenizers")) == 1
    assert first.info.chat_template == second.info.chat_template and "im_start" in second.info.chat_template
    assert second.info.eos_token_ids == [2] and second.info.vocab_size == 49152
    assert second.info.tokenizer.decode(second.info.tokenizer("Hello there")["input_ids"]) == "Hello there"
    # No fp32 weight matrix anywhere: the skeleton's projections stay on the meta device.
    model = second.loaded.model
    assert all(p.device.type == "meta" for n, p in model.named_parameters() if p.dim() == 2)


def test_switch_off_keeps_the_conversion(tmp_path) -> None:
    path = str(tmp_path / "tiny.Q8_0.gguf")
    gguf_writer.write_tiny_gguf(path, "llama", "Q8_0", layers=1)
    backend = make_backend(path, str(tmp_path / "cache"), gguf_native=False)
    assert "weights=gguf" not in backend.plan() and "linears=packed" in backend.plan()
    assert os.listdir(tmp_path / "cache" / "converted")


def test_an_unserved_tensor_type_is_one_line_config_error(tmp_path, shared_cache) -> None:
    import numpy as np

    path = str(tmp_path / "tiny-iq2.gguf")
    gguf_writer.write_tiny_gguf(path, "llama", "Q8_0", layers=1)
    # Rewrite one tensor's type in the table to IQ2_XXS (not served), with a payload of its size.
    import gguf

    reader = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(str(tmp_path / "iq2.gguf"), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        w.add_key_value(key, field.contents(), vtype,
                        sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        if t.name == "blk.0.ffn_up.weight":
            rows, cols = int(t.shape[1]), int(t.shape[0])
            blocks = np.zeros((rows, cols // 256 * 66), np.uint8)
            w.add_tensor(t.name, blocks, raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type if t.data.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError) as info:
        make_backend(str(tmp_path / "iq2.gguf"), shared_cache)
    message = str(info.value)
    assert "\n" not in message and "blk.0.ffn_up.weight" in message and "IQ2_XXS" in message


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize(("qtype", "bf16"), [("Q8_0", False), ("Q8_0", True)], ids=["Q8_0-exact", "Q8_0-bf16-matmul"])
def test_requantized_smollm2_greedy_equals_transformers_generate(qtype: str, bf16: bool, tmp_path) -> None:
    """The real SmolLM2 as Q8_0: greedy continuations through the engine equal transformers'
    generate on the weights dequantized from the same file: on the exact kernels and with
    ``gguf_bf16_matmul`` (whose batched steps round the weights to bf16)."""

    from engine.test_greedy_equality import MAX_NEW, PROMPTS, batched_greedy, run_engine
    from llmserve.plugins.backends.torch.native import gguf_ops

    if bf16 and not gguf_ops.amx_available():
        pytest.skip("this CPU has no AMX-BF16 tiles")
    try:
        gguf_writer.embedded_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    path = str(tmp_path / f"smollm2.{qtype}.gguf")
    gguf_writer.requantize_embedded(path, qtype)
    backend = TorchBackend(ServerConfig(model=path, dtype="float32", device="cpu", max_model_len=1024,
                                        cache_dir=str(tmp_path / "cache")),
                           TorchOptions(gguf_bf16_matmul=bf16, gguf_decode_activations="fp32"))
    info = backend.load()
    assert info.quantization == f"quantized as in the file: {qtype.lower()} 211 matrices"
    assert ("gguf_matmul=bf16-amx" in backend.plan()) == bf16
    ours, _ = run_engine((backend, info), PROMPTS)
    model = gguf_writer.reference_model(path)
    rows = batched_greedy(model, [info.tokenizer(p).input_ids for p in PROMPTS], info.tokenizer.eos_token_id,
                          max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW)
    same = sum(row == ours[p] for row, p in zip(rows, PROMPTS))
    # The bar for every path: 18 of 20 identical over all MAX_NEW tokens (this machine:
    # all 20 on each path, the bf16 one with the 20 prompts decoded as one batch).
    assert len(PROMPTS) == 20 and same >= 18, f"{same}/20 identical"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_requantized_smollm2_on_int8_activations_picks_transformers_tokens(tmp_path) -> None:
    """The real SmolLM2 as Q4_0 on int8 activations (the default for its Q4_0 matrices): fed
    transformers' greedy continuation of each of the 20 prompts (on the weights dequantized from
    the same file), the engine's top token is transformers' at >= 93% of the positions, and where
    it is not, the two were near a tie (< 0.5 apart in the engine's logits). Greedy runs are not
    the measure here: rounding every activation to 8 bits moves logits by ~1%, so a
    continuation leaves transformers' at its first near tie (this machine: 7 of 20 prompts kept
    all 24 tokens decoded one at a time; 457 of 480 positions agreed, the widest gap 0.29)."""

    from engine.test_greedy_equality import MAX_NEW, PROMPTS, batched_greedy

    try:
        gguf_writer.embedded_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    path = str(tmp_path / "smollm2.Q4_0.gguf")
    gguf_writer.requantize_embedded(path, "Q4_0")
    backend = make_backend(path, str(tmp_path / "cache"), num_blocks=64, gguf_decode_activations="auto")
    assert "gguf_decode=int8" in backend.plan()
    tok = backend.info.tokenizer
    prompts = [tok(p).input_ids for p in PROMPTS]
    rows = batched_greedy(gguf_writer.reference_model(path), prompts, tok.eos_token_id,
                          max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW)
    agree, total, widest = 0, 0, 0.0
    for prompt, row in zip(prompts, rows):
        ids = (prompt + row)[:-1]
        # steps of 16 rows, on the int8 path on every build (gguf_ops.int8_rows() >= 16)
        logits = torch.cat([backend.forward_logits([StepItem(seq_id=1, token_ids=ids[s:s + 16], start_pos=s,
                                                             block_table=list(range(64)))])[0]
                            for s in range(0, len(ids), 16)])[len(prompt) - 1:]
        top = logits.argmax(-1)
        want = torch.tensor(row)
        agree += int((top == want).sum())
        total += len(row)
        gaps = logits.gather(1, top[:, None]) - logits.gather(1, want[:, None])
        widest = max(widest, float(gaps.max()))
    assert total == 20 * MAX_NEW and agree >= 0.93 * total and widest < 0.5, (agree, total, widest)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_server_on_a_large_gguf_stays_near_the_file_size(tmp_path) -> None:
    """A ~300 MB Q8_0 llama served with a small KV pool: the server's resident memory is the
    file (mapped), the KV pool and the runtime, not an fp32 copy (4x the file).

    Counted: the process's anonymous memory (heap, tensors, the KV pool) plus the resident
    pages of the GGUF mapping. Not counted: the code pages of shared libraries (libtorch
    alone is 60-110 MB of them, depending on how much of the file the page cache held when it
    was mapped): clean, shared with every other torch process and reclaimable."""
    import httpx
    import psutil

    from conftest import ServerProcess

    path = tmp_path / "large.Q8_0.gguf"
    gguf_writer.write_large_q8_gguf(str(path))
    size = path.stat().st_size
    blocks, block_size = 64, 16
    kv_bytes = blocks * block_size * 12 * 2 * 4 * 64 * 4  # layers x (K, V) x kv heads x head dim x fp32
    server = ServerProcess("--model", str(path), "--cache-dir", str(tmp_path / "cache"), "--num-kv-blocks",
                           str(blocks), "--block-size", str(block_size), "--max-model-len", "512",
                           "--dtype", "float32")
    try:
        server.wait_ready(timeout=900)
        reply = httpx.post(f"{server.url}/v1/completions", timeout=300,
                           json={"model": "large.Q8_0.gguf", "prompt": "Hello", "max_tokens": 8}).json()
        assert reply["usage"]["completion_tokens"] >= 1
        procs = [psutil.Process(server.proc.pid)]
        procs += procs[0].children(recursive=True)
        rss = sum(p.memory_info().rss for p in procs)
        held = sum(_anonymous_and_mapped(p.pid, str(path)) for p in procs)
    finally:
        log = server.stop()
    print(f"GGUF {size / 2**20:.0f} MiB, KV {kv_bytes / 2**20:.0f} MiB, server RSS {rss / 2**20:.0f} MiB, "
          f"of which anonymous + the GGUF's pages {held / 2**20:.0f} MiB")
    assert "weights=gguf:q8_0" in log
    assert not (tmp_path / "cache" / "converted").exists()
    assert held <= size + kv_bytes + 400 * 2**20, (held, rss, size, kv_bytes)


def _anonymous_and_mapped(pid: int, path: str) -> int:
    """Bytes of ``pid``'s anonymous resident memory plus the resident pages of ``path``'s mapping."""
    total, current = 0, ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head, _, rest = line.partition(" ")
            if not head.endswith(":"):  # a mapping's first line: range perms offset dev inode [path]
                fields = line.split(None, 5)
                current = fields[5].strip() if len(fields) > 5 else ""
            elif head == "Anonymous:" or (head == "Rss:" and current == path):
                total += int(rest.split()[0]) * 1024
    return total
