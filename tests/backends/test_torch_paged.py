"""Paged attention of the torch backend against transformers' own forward, on a tiny random Llama."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from llmserve.config import ServerConfig
from llmserve.engine.backend import KVCacheSpec, StepItem
from llmserve.errors import ConfigError
from llmserve.plugins.backends.torch.native.ops import ElementwiseOps, PackedLinear
from llmserve.plugins.backends.torch.fused import TorchOps
from llmserve.plugins.backends.torch.options import TorchOptions
from llmserve.plugins.backends.torch.runner import TorchBackend
from llmserve.sampling import SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")
BS = 4  # small blocks so short sequences span several of them
VOCAB = 256


def build_tiny_model(path: str, arch: str = "llama", **overrides: object) -> None:
    """Save a 2-layer GQA model (Llama, Mistral, Qwen2 or Qwen3) with random weights and a
    word-level tokenizer."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               initializer_range=0.2, tie_word_embeddings=False, eos_token_id=1, bos_token_id=0)
    cfg.update(overrides)
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
                             "qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    torch.manual_seed(0)
    model_cls(config_cls(**cfg)).save_pretrained(path)
    save_word_tokenizer(path)


def save_word_tokenizer(path: str) -> None:
    """A word-level tokenizer of ``VOCAB`` words ``t0 t1 ...`` (``t0`` the BOS, ``t1`` the EOS; encoding
    adds neither). As special tokens, ``t0`` and ``t1`` also match inside longer words: "t107" encodes
    as ``t1`` + an unknown word, so text prompts keep to words that do not start with them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", bos_token="t0").save_pretrained(path)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    build_tiny_model(path)
    return path


@pytest.fixture(scope="module")
def reference(tiny_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32, attn_implementation="sdpa").eval()

    def logits(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0].float()

    return logits


def make_backend(path: str, num_blocks: int = 64, fused: bool = True, kernel: bool = True) -> TorchBackend:
    """``fused``: ask for the backend's own forward (which every architecture here takes);
    ``kernel``: decode attention and linear layers in the native CPU kernels (which must then be
    built), else torch. The other options come from the environment, as without a server."""
    backend = TorchBackend(ServerConfig(model=path, dtype="float32", device="cpu", max_model_len=None),
                           TorchOptions.from_environ(fused_forward=fused, cpu_kernels=kernel))
    backend.load()
    assert (backend._fused is not None) == fused
    if backend._fused is not None:  # every step must then run the fused forward, never transformers'
        def transformers_forward(*args: object, **kwargs: object) -> None:
            raise AssertionError("transformers' forward ran although the fused forward was built")

        backend._decoder = transformers_forward
    backend.init_kv_cache(KVCacheSpec(block_size=BS, num_blocks=num_blocks))
    if kernel:
        assert backend.cache.decode_kernel is not None, "the CPU decode kernel did not build (is gcc installed?)"
        assert backend.cache.prefill_kernel is not None, "the CPU prefill kernel did not build"
        assert isinstance(backend._packed_head, PackedLinear), "the CPU linear kernel did not build"
        if backend._fused is not None:
            assert all(isinstance(lay.qkv, PackedLinear) and isinstance(lay.down, PackedLinear)
                       for lay in backend._fused.layers)
            assert isinstance(backend._fused.ops, ElementwiseOps), "the CPU elementwise kernels did not build"
        assert backend.sampler.greedy_kernel is not None
    else:
        assert backend._packed_head is None
        assert backend._fused is None or isinstance(backend._fused.ops, TorchOps)
        assert backend.sampler.greedy_kernel is None
        backend.cache.decode_kernel = backend.cache.prefill_kernel = None
    # Simulate allocator garbage: never-written slots must not leak into attention (NaN * 0 = NaN).
    backend.cache.pool[:, :, :, :num_blocks].fill_(float("nan"))
    return backend


@pytest.fixture(params=[(True, True), (True, False), (False, False)],
                ids=["fused-kernel", "fused-torch", "transformers-torch"])
def backend(tiny_dir: str, request: pytest.FixtureRequest) -> TorchBackend:
    """The backend with its own fused forward and with transformers' modules, decode attention in
    the native kernel and in torch (all must agree)."""
    fused, kernel = request.param
    b = make_backend(tiny_dir, fused=fused, kernel=kernel)
    yield b
    b.close()


def seq(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (n,), generator=g).tolist()


def item(seq_id: int, ids: list[int], start: int, table: list[int], **kw: object) -> StepItem:
    return StepItem(seq_id=seq_id, token_ids=ids, start_pos=start, block_table=table, **kw)


def check(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_model_info(backend: TorchBackend, tiny_dir: str) -> None:
    info = backend.load()
    assert info.vocab_size == VOCAB and info.eos_token_ids == [1]
    assert info.max_model_len == 256 and info.name == os.path.basename(tiny_dir)
    assert info.dtype == "float32" and info.device == "cpu"


def test_single_prefill(backend: TorchBackend, reference) -> None:
    ids = seq(1, 11)
    (got,) = backend.forward_logits([item(0, ids, 0, [5, 6, 7])])
    check(got, reference(ids))


def test_several_sequences_one_batch(backend: TorchBackend, reference) -> None:
    seqs = [seq(2, 3), seq(3, 9), seq(4, 1), seq(5, 16)]
    tables = [[0], [1, 2, 3], [4], [8, 9, 10, 11]]
    got = backend.forward_logits([item(i, s, 0, t) for i, (s, t) in enumerate(zip(seqs, tables))])
    for g, s in zip(got, seqs):
        check(g, reference(s))


def test_chunked_prefill_then_decode(backend: TorchBackend, reference) -> None:
    ids = seq(6, 20)
    table = [9, 3, 14, 0, 22, 7]  # non-contiguous, out of order
    parts = [backend.forward_logits([item(0, ids[a:b], a, table)])[0] for a, b in ((0, 5), (5, 6), (6, 13), (13, 18))]
    for pos in (18, 19):  # decode tokens one at a time
        parts.append(backend.forward_logits([item(0, [ids[pos]], pos, table)])[0])
    check(torch.cat(parts), reference(ids))


def test_mixed_prefill_and_decode_batch(backend: TorchBackend, reference) -> None:
    a, b, c, d = seq(7, 12), seq(8, 7), seq(9, 15), seq(10, 5)
    ta, tb, tc, td = [30, 2, 17, 5], [11, 40], [6, 33, 20, 1], [50, 51]
    # Step 1: prefill a fully, b partly, c partly.
    backend.forward_logits([item(0, a[:10], 0, ta), item(1, b[:5], 0, tb), item(2, c[:4], 0, tc)])
    # Step 2: a and b decode, c continues its prefill, d starts; batch order deliberately mixed.
    got = backend.forward_logits([
        item(2, c[4:13], 4, tc), item(0, [a[10]], 10, ta), item(3, d, 0, td), item(1, [b[5]], 5, tb),
    ])
    check(got[0], reference(c[:13])[4:13])
    check(got[1], reference(a[:11])[10:11])
    check(got[2], reference(d))
    check(got[3], reference(b[:6])[5:6])
    # Step 3: everyone decodes (different context lengths, padding to the longest).
    got = backend.forward_logits([item(0, [a[11]], 11, ta), item(1, [b[6]], 6, tb), item(2, [c[13]], 13, tc)])
    check(got[0], reference(a)[11:12])
    check(got[1], reference(b)[6:7])
    check(got[2], reference(c[:14])[13:14])


def test_step_samples_greedy_and_prompt_logprobs(backend: TorchBackend, reference) -> None:
    ids = seq(11, 9)
    greedy = SamplingParams(temperature=0, logprobs=2, prompt_logprobs=3)
    (res,) = backend.step([item(4, ids, 0, [1, 2, 3], sampling=greedy, prompt_logprob_targets=ids[1:])])
    ref = reference(ids).log_softmax(-1)
    assert res.seq_id == 4 and res.token_id == int(ref[-1].argmax())
    assert res.logprob == pytest.approx(float(ref[-1].max()), abs=1e-4)
    assert [t for t, _ in res.top] == ref[-1].topk(2).indices.tolist()
    assert len(res.prompt_logprobs) == 8
    for k, (lp, top) in enumerate(res.prompt_logprobs):
        assert lp == pytest.approx(float(ref[k, ids[k + 1]]), abs=1e-4)
        assert [t for t, _ in top] == ref[k].topk(3).indices.tolist()


def test_prompt_logprobs_across_chunks(backend: TorchBackend, reference) -> None:
    ids = seq(16, 10)
    table = [7, 3, 12]
    params = SamplingParams(temperature=0, prompt_logprobs=1)
    ref = reference(ids).log_softmax(-1)
    (r1,) = backend.step([item(0, ids[:5], 0, table, sample=False, sampling=params, prompt_logprob_targets=ids[1:6])])
    (r2,) = backend.step([item(0, ids[5:9], 5, table, sample=False, sampling=params, prompt_logprob_targets=ids[6:9])])
    (r3,) = backend.step([item(0, ids[9:], 9, table, sampling=params, prompt_logprob_targets=[])])
    got = r1.prompt_logprobs + r2.prompt_logprobs
    assert r1.token_id is None and len(got) == 8 and r3.prompt_logprobs == [] and r3.token_id is not None
    for k, (lp, top) in enumerate(got):
        assert lp == pytest.approx(float(ref[k, ids[k + 1]]), abs=1e-4)
        assert top[0][0] == int(ref[k].argmax())
    assert r3.token_id == int(ref[9].argmax())


def test_results_follow_batch_order_and_no_sample(backend: TorchBackend) -> None:
    greedy = SamplingParams(temperature=0)
    batch = [item(7, seq(12, 6), 0, [0, 1], sample=False),
             item(3, seq(13, 4), 0, [2], sampling=greedy),
             item(9, seq(14, 5), 0, [3, 4], sampling=greedy)]
    res = backend.step(batch)
    assert [r.seq_id for r in res] == [7, 3, 9]
    assert res[0].token_id is None and res[1].token_id is not None and res[2].token_id is not None
    assert backend.step([]) == []


def test_kv_cache_too_small_raises(tiny_dir: str) -> None:
    from llmserve.engine.engine import LLMEngine

    b = TorchBackend(ServerConfig(model=tiny_dir, dtype="float32", device="cpu"))
    info = b.load()
    with pytest.raises(ConfigError, match="max-model-len"):  # a given length the pool cannot hold: refused
        LLMEngine(b, info, ServerConfig(block_size=16, num_kv_blocks=3, max_model_len=256))
    # None given: the trained 256 tokens shrink to the 48 the pool holds.
    assert LLMEngine(b, info, ServerConfig(block_size=16, num_kv_blocks=3)).max_model_len == 48 == info.max_model_len
    assert b.init_kv_cache(KVCacheSpec(block_size=16, memory_fraction=0.001, min_blocks=1)) >= 1
    with pytest.raises(ConfigError, match="cannot allocate"):
        b.init_kv_cache(KVCacheSpec(block_size=16, num_blocks=10**13))


def test_max_model_len_capped(tiny_dir: str) -> None:
    b = TorchBackend(ServerConfig(model=tiny_dir, dtype="float32", device="cpu", max_model_len=100000))
    assert b.load().max_model_len == 256
    b = TorchBackend(ServerConfig(model=tiny_dir, dtype="float32", device="cpu", max_model_len=64))
    assert b.load().max_model_len == 64


ARCHITECTURES = [("mistral", {"sliding_window": 6}),                 # a window shorter than the prompt
                 ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1,
                            "layer_types": ["full_attention", "sliding_attention"]}),  # biased QKV, one windowed layer
                 ("qwen3", {"head_dim": 32, "use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1,
                            "layer_types": ["full_attention", "sliding_attention"]})]  # q/k norms, heads of 32 on 64


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "transformers"])
@pytest.mark.parametrize("arch,overrides", ARCHITECTURES, ids=[a for a, _ in ARCHITECTURES])
def test_architectures_match_reference(tmp_path, arch: str, overrides: dict, fused: bool) -> None:
    """Other Llama-style architectures: chunked prefill and decode (beyond the window where one is set)."""
    from transformers import AutoModelForCausalLM

    build_tiny_model(str(tmp_path), arch=arch, **overrides)
    ref_model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    if arch == "qwen2":  # random biases, so a bias left out of the fused matmul shows
        assert ref_model.model.layers[0].self_attn.q_proj.bias is not None
        with torch.no_grad():
            for layer in ref_model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
        ref_model.save_pretrained(tmp_path)
    ids = seq(15, 17)
    with torch.inference_mode():
        want = ref_model(torch.tensor([ids])).logits[0]
    b = make_backend(str(tmp_path), fused=fused)
    table = [4, 0, 7, 2, 9]
    parts = [b.forward_logits([item(0, ids[:9], 0, table)])[0], b.forward_logits([item(0, ids[9:15], 9, table)])[0]]
    parts += [b.forward_logits([item(0, [ids[p]], p, table)])[0] for p in (15, 16)]
    check(torch.cat(parts), want)


def test_fused_weights_are_shared_with_the_transformers_model(tiny_dir: str, reference) -> None:
    """Fusing (without the packed kernels) re-points the model's own parameters at slices of the
    fused matrices: no second copy, and the transformers model still computes the same logits."""
    b = make_backend(tiny_dir, fused=True, kernel=False)
    layer, fused = b.loaded.model.model.layers[0], b._fused.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    qkv_w, gu_w = fused.qkv.weight, fused.gu.weight
    assert attn.q_proj.weight.data_ptr() == qkv_w.data_ptr()
    assert attn.v_proj.weight.data_ptr() + attn.v_proj.weight.numel() * 4 == qkv_w.data_ptr() + qkv_w.numel() * 4
    assert mlp.gate_proj.weight.data_ptr() == gu_w.data_ptr()
    ids = seq(30, 9)
    b.loaded.model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        check(b.loaded.model(torch.tensor([ids])).logits[0], reference(ids))


def test_packed_weights_replace_the_unpacked_ones(tiny_dir: str) -> None:
    """With the packed kernels the layer projections are stored once, in the packed layout: the
    transformers layers are left with empty weights (and fail loudly if called)."""
    b = make_backend(tiny_dir, fused=True, kernel=True)
    layer = b.loaded.model.model.layers[0]
    for proj in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.up_proj, layer.mlp.down_proj):
        assert proj.weight.numel() == 0
    lay = b._fused.layers[0]
    assert (lay.qkv.out_features, lay.qkv.in_features) == (
        (layer.self_attn.q_proj.out_features + 2 * layer.self_attn.k_proj.out_features),
        layer.self_attn.q_proj.in_features)
    with pytest.raises(RuntimeError):
        with torch.inference_mode():
            b.loaded.model(torch.tensor([[1, 2, 3]]))


def test_native_decode_step_is_bit_identical_to_the_layer_loop(tiny_dir: str, monkeypatch) -> None:
    """Decode-only steps run every layer in one native call (native/step.py); they must give
    exactly the Python layer loop's hidden states and KV writes, step after step.
    LLMSERVE_NATIVE_STEP=0 keeps the loop."""
    from llmserve.plugins.backends.torch.native.step import NativeDecodeStep

    monkeypatch.delenv("LLMSERVE_NATIVE_STEP", raising=False)
    native = make_backend(tiny_dir)
    monkeypatch.setenv("LLMSERVE_NATIVE_STEP", "0")
    loop = make_backend(tiny_dir)
    calls = []
    real_call = NativeDecodeStep.__call__

    def counted(self, *args):
        calls.append(self)
        return real_call(self, *args)

    seqs = [seq(40 + i, n) for i, n in enumerate((5, 9, 3))]
    tables = [[3, 7, 1, 12], [20, 5, 9, 30], [8, 2, 40, 41]]
    try:
        NativeDecodeStep.__call__ = counted
        for b in (native, loop):  # prefill: the Python loop on both
            b.forward_logits([item(i, s, 0, t) for i, (s, t) in enumerate(zip(seqs, tables))])
        assert not calls
        ctx = [len(s) for s in seqs]
        for step in range(4):  # decode-only steps, uneven contexts crossing block boundaries
            batch = [item(i, [(7 * step + i) % VOCAB + 2], ctx[i] + step, t) for i, t in enumerate(tables)]
            got, want = native.forward_logits(batch), loop.forward_logits(batch)
            for g, w in zip(got, want):
                assert torch.equal(g, w)
        assert len(calls) == 4 and loop._fused._native is None
        assert torch.equal(native.cache.pool.nan_to_num(nan=7.0), loop.cache.pool.nan_to_num(nan=7.0))
    finally:
        NativeDecodeStep.__call__ = real_call
        native.close(), loop.close()


@pytest.fixture(scope="module")
def q4_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama with its projections rounded the way GGUF Q4_1 stores them (per row and
    32 consecutive k: w = d * q + m, q in 0..15, d an fp16 number) and its lm_head the way
    Q8_0 does (w = d * q, q in -127..127), like the embedded model."""
    from transformers import AutoModelForCausalLM

    path = str(tmp_path_factory.mktemp("tiny-llama-q4"))
    build_tiny_model(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for _name, module in model.model.layers.named_modules():
        if isinstance(module, torch.nn.Linear):
            w = module.weight.data
            blocks = w.reshape(w.shape[0], -1, 32)
            lo, hi = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
            d = ((hi - lo) / 15).half().float()
            q = torch.round((blocks - lo) / d).clamp(0, 15)
            module.weight.data = (d * q + lo).reshape(w.shape)
    w = model.lm_head.weight.data
    blocks = w.reshape(w.shape[0], -1, 32)
    d = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
    model.lm_head.weight.data = (d * (torch.round(blocks / d).clamp(-127, 127) + 0.0)).reshape(w.shape)  # no -0.0
    model.save_pretrained(path)
    return path


def test_quantized_panels_give_the_fp32_panels_logits(q4_dir: str, tiny_dir: str, monkeypatch) -> None:
    """A model whose projections 4-bit panels reproduce gets them, and its lm_head 8-bit ones
    (the random model gets neither); its logits are the fp32 panels' bit for bit: prefill
    (dequantized scratch panels) and decode steps of 3 and of 1 rows (straight from the codes)
    in the native step."""
    monkeypatch.delenv("LLMSERVE_COMPACT_WEIGHTS", raising=False)
    q4 = make_backend(q4_dir)
    plain = make_backend(tiny_dir)
    monkeypatch.setenv("LLMSERVE_COMPACT_WEIGHTS", "0")
    f32 = make_backend(q4_dir)
    projections = ("qkv", "o", "gu", "down")
    assert {getattr(lay, p).format for lay in q4._fused.layers for p in projections} == {"q4"}
    assert {getattr(lay, p).format for lay in f32._fused.layers for p in projections} == {"f32"}
    assert {getattr(lay, p).format for lay in plain._fused.layers for p in projections} == {"f32"}
    assert (q4._packed_head.format, f32._packed_head.format, plain._packed_head.format) == ("q8", "f32", "f32")
    seqs = [seq(60 + i, n) for i, n in enumerate((6, 11, 4))]
    tables = [[3, 7, 1, 12], [20, 5, 9, 30], [8, 2, 40, 41]]
    try:
        got = q4.forward_logits([item(i, s, 0, t) for i, (s, t) in enumerate(zip(seqs, tables))])
        want = f32.forward_logits([item(i, s, 0, t) for i, (s, t) in enumerate(zip(seqs, tables))])
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        ctx = [len(s) for s in seqs]
        for step in range(3):
            rows = range(3) if step < 2 else range(1)
            batch = [item(i, [(5 * step + i) % VOCAB + 2], ctx[i] + step, tables[i]) for i in rows]
            got, want = q4.forward_logits(batch), f32.forward_logits(batch)
            assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert q4._fused._native is not None and q4._fused._native[1] is not None  # the native step ran
    finally:
        q4.close(), f32.close(), plain.close()


def test_native_decode_step_refuses_a_slot_outside_the_pool(tiny_dir: str) -> None:
    b = make_backend(tiny_dir)
    b.forward_logits([item(0, seq(50, 4), 0, [2, 3])])
    with pytest.raises(IndexError):  # the block id points past the pool
        b.forward_logits([item(0, [5], 4, [2, 10_000])])
    b.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_matches_cpu(tiny_dir: str, reference) -> None:
    b = TorchBackend(ServerConfig(model=tiny_dir, dtype="float32", device="cuda"))
    assert b.load().device == "cuda"
    b.init_kv_cache(KVCacheSpec(block_size=BS, num_blocks=32))
    a, c = seq(20, 10), seq(21, 6)
    b.forward_logits([item(0, a[:9], 0, [3, 1, 7])])
    got = b.forward_logits([item(0, [a[9]], 9, [3, 1, 7]), item(1, c, 0, [5, 9])])
    torch.testing.assert_close(got[0].cpu(), reference(a)[9:10], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(got[1].cpu(), reference(c), atol=1e-3, rtol=1e-3)
    res = b.step([item(1, [c[-1]], 6, [5, 9], sampling=SamplingParams(seed=3, logprobs=2)),
                  item(2, a, 0, [10, 11, 12], sampling=SamplingParams(temperature=0))])
    assert all(r.token_id is not None for r in res)
    b.close()


def test_fused_forward_takes_any_attention_output_layout(tiny_dir: str, reference, monkeypatch) -> None:
    """The attention kernel chooses its output's memory layout: CUDA's SDPA returns batched decode
    rows with the heads apart in memory (a layout no view can flatten), and the fused forward must
    still read it. Here every attention output is handed over in that layout, on the CPU."""
    from llmserve.plugins.backends.torch import fused as fused_module

    real = fused_module.paged_attention

    def heads_apart(*args: object, **kwargs: object) -> torch.Tensor:
        out = real(*args, **kwargs)                      # [T, H, D]
        return out.transpose(0, 1).contiguous().transpose(0, 1)

    monkeypatch.setattr(fused_module, "paged_attention", heads_apart)
    b = make_backend(tiny_dir, fused=True, kernel=False)
    a, c = seq(22, 10), seq(23, 6)
    b.forward_logits([item(0, a[:9], 0, [3, 1, 7]), item(1, c[:5], 0, [5, 9])])
    got = b.forward_logits([item(0, [a[9]], 9, [3, 1, 7]), item(1, [c[5]], 5, [5, 9])])
    check(got[0], reference(a)[9:10])
    check(got[1], reference(c)[5:6])
    b.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "transformers"])
def test_cuda_batched_decode_matches_cpu(tiny_dir: str, reference, fused: bool) -> None:
    """Twelve sequences prefilled in one step, then decoded together, as a server batches them."""
    b = TorchBackend(ServerConfig(model=tiny_dir, dtype="float32", device="cuda", max_model_len=None),
                     TorchOptions.from_environ(fused_forward=fused))
    b.load()
    assert (b._fused is not None) == fused
    b.init_kv_cache(KVCacheSpec(block_size=BS, num_blocks=128))
    seqs = [seq(40 + i, 3 + i) for i in range(12)]
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(12)]
    b.forward_logits([item(i, s[:-1], 0, t) for i, (s, t) in enumerate(zip(seqs, tables))])
    got = b.forward_logits([item(i, [s[-1]], len(s) - 1, t) for i, (s, t) in enumerate(zip(seqs, tables))])
    for g, s in zip(got, seqs):
        torch.testing.assert_close(g.cpu(), reference(s)[-1:], atol=1e-3, rtol=1e-3)
    b.close()


@pytest.mark.parametrize("value,fused", [("0", False), ("off", False), ("1", True), (None, True)])
def test_fused_forward_environment_switch(tiny_dir: str, monkeypatch, value: str | None, fused: bool) -> None:
    """LLMSERVE_FUSED_FORWARD=0 keeps transformers' modules (the comparison the docs describe)."""
    if value is None:
        monkeypatch.delenv("LLMSERVE_FUSED_FORWARD", raising=False)
    else:
        monkeypatch.setenv("LLMSERVE_FUSED_FORWARD", value)
    b = TorchBackend(ServerConfig(model=tiny_dir, dtype="float32", device="cpu", max_model_len=None))
    b.load()
    assert (b._fused is not None) == fused


def test_a_refused_model_keeps_its_weights_when_packing(tiny_dir: str) -> None:
    """Packing starts only once every layer is understood: a layer the fused forward refuses
    (here mixed q/k/v biases in the last layer) leaves every transformers weight in place."""
    from transformers import AutoModelForCausalLM

    from llmserve.plugins.backends.torch.fused import FusedDecoder

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    last = model.model.layers[-1].self_attn
    last.q_proj.bias = torch.nn.Parameter(torch.zeros(last.q_proj.out_features))
    assert FusedDecoder.build(model, pack=True) is None
    for layer in model.model.layers:
        assert layer.self_attn.q_proj.weight.numel() > 0 and layer.mlp.down_proj.weight.numel() > 0
    with torch.inference_mode():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
