"""Gemma 4 text models on the engine (``fused_gemma4.py`` and transformers' forward over the paged
cache): the small models' shape (per-layer embeddings, layers reading an earlier layer's keys and
values), the 31B's (global layers of fewer, wider heads whose keys are their values) and the
26B-A4B's (experts beside the dense MLP) answer as transformers does: logits of one pass, of a
prompt split at every point, of sequences decoding side by side, and greedy continuations alone,
four at once, in small prefill chunks and from the prefix cache. The cache keeps each layer in its
own shape and gives the reading layers none."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine.test_greedy_equality import MAX_NEW, run_engine
from transformers import PreTrainedTokenizerFast

from llmserve.config import ServerConfig
from llmserve.engine.backend import KVCacheSpec, StepItem
from llmserve.errors import ConfigError
from llmserve.plugins.backends.torch.attention import PagedKVCache
from llmserve.plugins.backends.torch.fused_gemma4 import Gemma4Decoder
from llmserve.plugins.backends.torch.options import TorchOptions
from llmserve.plugins.backends.torch.runner import TorchBackend
from llmserve.sampling import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import gemma4_model
from backends.test_hybrid_models import BS, close_to, table
from hybrid_model import reference_generate, reference_logits

WORDS = [i for i in range(3, gemma4_model.VOCAB) if not str(i).startswith(("0", "1"))]


def ids_of(seed: int, n: int) -> list[int]:
    picks = torch.randint(0, len(WORDS), (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return [WORDS[i] for i in picks]


# Under one window, past it, and past several windows and blocks.
PROMPTS = [ids_of(1, 5), ids_of(2, 13), ids_of(3, 45), ids_of(4, 70)]


@dataclasses.dataclass
class Served:
    backend: TorchBackend
    info: object
    reference: torch.nn.Module
    name: str


# "fused-bf16": a bf16 checkpoint computed in float32 on the CPU, its projections kept as bf16 rows.
RUNS = [(name, forward) for name in sorted(gemma4_model.SHAPES) for forward in ("fused", "transformers")] + [
    ("e2b", "fused-bf16"), ("moe", "fused-bf16")]


@pytest.fixture(scope="module", params=RUNS, ids=[f"{n}-{f}" for n, f in RUNS])
def served(request, tmp_path_factory):
    name, forward = request.param
    path = str(tmp_path_factory.mktemp(f"gemma4-{name}"))
    bf16 = forward == "fused-bf16"
    reference = gemma4_model.write_gemma4(name, path, dtype=torch.bfloat16 if bf16 else torch.float32)
    backend = TorchBackend(ServerConfig(model=path, dtype="float32", device="cpu"),
                           TorchOptions.from_environ(fused_forward=forward != "transformers"))
    info = dataclasses.replace(backend.load(), tokenizer=PreTrainedTokenizerFast.from_pretrained(path))
    assert isinstance(backend._fused, Gemma4Decoder) == (forward != "transformers")
    if bf16:  # every projection and the embeddings read from bf16 rows; nothing held in bf16 elsewhere
        assert "bf16" in (info.quantization or ""), info.quantization
        assert not [n for n, p in backend.loaded.model.named_parameters() if p.dtype == torch.bfloat16 and p.numel()]
    yield Served(backend, info, reference, name)
    backend.close()


def fresh_cache(backend: TorchBackend, blocks: int = 64) -> None:
    backend.init_kv_cache(KVCacheSpec(block_size=BS, num_blocks=blocks))


def test_each_layer_keeps_its_own_shape(served) -> None:
    """Sliding layers 2 heads of 16, global layers heads of 32 (one where keys are values, as
    the 31B's); the reading layers (e2b's last three) keep nothing."""
    be = served.backend
    fresh_cache(be)
    cache = be.cache
    wide = 2 if served.name == "e2b" else 1
    assert cache.shapes == [(2, 16), (2, 16), (wide, 32)] * (1 if served.name == "e2b" else 2)
    assert [tuple(view.shape) for view, _ in cache.layers[:3]] == [(4, 65, BS, 16)] * 2 + [(2 * wide, 65, BS, 32)]
    assert all(view.is_contiguous() for view, _ in cache.layers)
    per_token = sum(2 * h * d * 4 for h, d in cache.shapes)
    assert cache.pool.numel() * 4 == per_token * 65 * BS
    if served.name == "e2b":
        assert cache.layer_of == {0: 0, 1: 1, 2: 2, 3: 1, 4: 1, 5: 2}


def test_one_pass_equals_transformers(served) -> None:
    be = served.backend
    fresh_cache(be)
    for n, ids in enumerate(PROMPTS):
        ours = be.forward_logits([StepItem(seq_id=n, token_ids=ids, start_pos=0, block_table=table(8 * n, len(ids)))])
        close_to(ours[0], reference_logits(served.reference, ids), f"{len(ids)} tokens in one pass")


def test_a_prompt_split_at_every_point_equals_one_pass(served) -> None:
    be = served.backend
    fresh_cache(be)
    ids = PROMPTS[2]
    ref = reference_logits(served.reference, ids)
    for cut in range(1, len(ids), 3):
        tab = table(0, len(ids))
        parts = [be.forward_logits([StepItem(seq_id=0, token_ids=ids[a:b], start_pos=a, block_table=tab)])[0]
                 for a, b in ((0, cut), (cut, len(ids)))]
        close_to(torch.cat(parts), ref, f"split at {cut}")


def test_sequences_of_different_lengths_decode_together(served) -> None:
    be = served.backend
    fresh_cache(be)
    seqs = [PROMPTS[0] + ids_of(10, 4), PROMPTS[1] + ids_of(11, 4), PROMPTS[3] + ids_of(12, 4)]
    tables = [table(0, 9), table(1, 17), table(3, 74)]
    n = [5, 13, 70]
    got = [[logits] for logits in be.forward_logits([StepItem(seq_id=i, token_ids=s[:n[i]], start_pos=0,
                                                              block_table=tables[i]) for i, s in enumerate(seqs)])]
    for t in range(4):
        outs = be.forward_logits([StepItem(seq_id=i, token_ids=[seqs[i][n[i] + t]], start_pos=n[i] + t,
                                           block_table=tables[i]) for i in range(3)])
        for i, logits in enumerate(outs):
            got[i].append(logits)
    for i, s in enumerate(seqs):
        close_to(torch.cat(got[i]), reference_logits(served.reference, s), f"sequence {i}")


def test_greedy_continuations_equal_generate(served) -> None:
    want = {i: reference_generate(served.reference, p, MAX_NEW) for i, p in enumerate(PROMPTS)}
    texts = [" ".join(f"t{t}" for t in p) for p in PROMPTS]
    pair = (served.backend, served.info)
    runs = {
        "alone": run_engine(pair, texts, sequential=True, enable_prefix_caching=False)[0],
        "four at once": run_engine(pair, texts)[0],
        "in 16-token steps": run_engine(pair, texts, max_num_batched_tokens=16)[0],
    }
    cached, engine = run_engine(pair, [texts[3]], passes=2)
    assert engine.block_manager.prefix_hit_tokens >= 64, "the second pass did not come from the prefix cache"
    runs["from the prefix cache"] = cached
    for name, got in runs.items():
        for i, text in enumerate(texts):
            if text in got:
                assert got[text] == want[i], f"{name}: prompt {i} answers {got[text]}, generate {want[i]}"


def test_a_cache_of_mixed_shapes_clears_and_counts_every_layer() -> None:
    """Two layer shapes in one allocation: the null block of each starts zeroed, ``zero_blocks``
    clears a block in every layer, and the byte count is the sum of the layers'."""
    shapes = [(2, 16), (1, 32), (2, 16)]
    cache = PagedKVCache(3, 4, 8, 2, 16, torch.float32, torch.device("cpu"), native=False, shapes=shapes)
    assert PagedKVCache.bytes_per_block(3, 8, 2, 16, torch.float32, shapes) == 8 * 4 * 2 * (32 + 32 + 32)
    for view, _ in cache.layers:
        assert not view[:, 4].any()
        view.fill_(1.0)
    cache.zero_blocks(torch.tensor([2]))
    for view, _ in cache.layers:
        assert not view[:, 2].any() and bool((view[:, 1] == 1.0).all())
    with pytest.raises(ValueError, match="2 layer shapes for 3"):
        PagedKVCache(3, 4, 8, 2, 16, torch.float32, torch.device("cpu"), shapes=shapes[:2])


def test_a_whole_checkpoint_serves_its_language_model_alone(tmp_path, caplog) -> None:
    """A Hub checkpoint (``gemma4``, a vision tower beside the language model) loads its language
    model's weights only and answers as the whole model does on text; an image is refused."""
    reference = gemma4_model.write_gemma4_checkpoint(str(tmp_path))
    backend = TorchBackend(ServerConfig(model=str(tmp_path), dtype="float32", device="cpu"))
    info = backend.load()
    try:
        assert isinstance(backend._fused, Gemma4Decoder) and info.input_modalities == ("text",)
        assert not any("vision" in name for name, _ in backend.loaded.model.named_parameters())
        fresh_cache(backend)
        ids = PROMPTS[3]
        ours = backend.forward_logits([StepItem(seq_id=0, token_ids=ids, start_pos=0, block_table=table(0, len(ids)))])
        close_to(ours[0], reference_logits(reference, ids), "the whole checkpoint's language model")
    finally:
        backend.close()


def test_a_checkpoint_missing_language_weights_is_refused(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    gemma4_model.write_gemma4_checkpoint(str(tmp_path))
    shard = tmp_path / "model.safetensors"
    tensors = load_file(str(shard))
    dropped = next(k for k in tensors if k.startswith("model.language_model.layers.2."))
    del tensors[dropped]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    backend = TorchBackend(ServerConfig(model=str(tmp_path), dtype="float32", device="cpu"))
    with pytest.raises(ConfigError, match="lacks 1 of its weights") as err:
        backend.load()
    assert "\n" not in str(err.value) and dropped.replace("language_model.", "") in str(err.value)


@pytest.mark.parametrize("served", [("e2b", "fused"), ("e2b", "fused-bf16")], indirect=True,
                         ids=["e2b-fused", "e2b-fused-bf16"])
def test_the_reading_layers_run_only_the_rows_a_step_reads(served, monkeypatch) -> None:
    """A step of a 13-token prompt that samples, a 45-token chunk that does not and a decode row:
    the layers that read earlier layers' keys (e2b's last three) run the two sampled rows alone,
    and what is sampled is what every row's logits say."""
    from llmserve.plugins.backends.torch import fused_gemma4

    be = served.backend
    fresh_cache(be)
    seen: list[int] = []
    real = fused_gemma4.paged_attention
    monkeypatch.setattr(fused_gemma4, "paged_attention", lambda *a, **k: seen.append(a[4].shape[0]) or real(*a, **k))
    a, b, c = PROMPTS[1], PROMPTS[2], PROMPTS[0]
    be.forward_logits([StepItem(seq_id=2, token_ids=c, start_pos=0, block_table=table(20, 6))])
    greedy = SamplingParams(temperature=0)
    batch = [StepItem(seq_id=0, token_ids=a, start_pos=0, block_table=table(0, 13), sampling=greedy),
             StepItem(seq_id=1, token_ids=b, start_pos=0, block_table=table(4, 45), sample=False),
             StepItem(seq_id=2, token_ids=[7], start_pos=5, block_table=table(20, 6), sampling=greedy)]
    seen.clear()
    results = be.step(batch)
    assert seen == [59] * 3 + [2] * 3, seen  # three writing layers over every row, three reading ones over two
    assert results[1].token_id is None
    ref_a = reference_logits(served.reference, a)[-1]
    ref_c = reference_logits(served.reference, c + [7])[-1]
    assert results[0].token_id == int(ref_a.argmax()) and results[2].token_id == int(ref_c.argmax())


@pytest.mark.parametrize("served", [("moe", "fused"), ("moe", "fused-bf16")], indirect=True,
                         ids=["moe-fused", "moe-fused-bf16"])
def test_the_experts_are_picked_and_weighted_as_transformers_does(served) -> None:
    """Gemma 4's router (an unscaled norm of the residual stream times a learned scale, softmax
    over every expert, the top two renormalised, times each expert's learned scale): the same
    experts and weights as transformers' ``Gemma4TextRouter`` on the same rows."""
    model = served.reference
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3)) * 3
    for lay, dec in zip(served.backend._fused.layers, model.model.layers):
        ours_experts, ours_weights = lay.moe.route(x)
        with torch.no_grad():
            _, weights, experts = dec.router(x)
        assert torch.equal(ours_experts.sort(-1).values, experts.sort(-1).values)
        order, ref_order = ours_experts.argsort(-1), experts.argsort(-1)
        torch.testing.assert_close(ours_weights.gather(-1, order), weights.gather(-1, ref_order), rtol=1e-5, atol=1e-6)
