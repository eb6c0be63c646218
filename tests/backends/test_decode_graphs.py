"""Graphed decode steps: the bookkeeping of ``cuda/graphs.py`` (persistent buffers, padded
buckets, eager steps in between) checked on the CPU with a stand-in graph that re-runs the
forward, the graphed region proven free of host syncs on the meta device, and the operators'
CPU path against the torch attention."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llmserve.config import ServerConfig
from llmserve.engine.backend import KVCacheSpec
from llmserve.plugins.backends.torch.attention import PagedKVCache, StepMetadata
from llmserve.plugins.backends.torch.cuda.graphs import DecodeGraphs, buckets, eager_capture
from llmserve.plugins.backends.torch.cuda.ops import KernelOps
from llmserve.plugins.backends.torch.fused import FusedDecoder, TorchOps
from llmserve.plugins.backends.torch.options import TorchOptions
from llmserve.plugins.backends.torch.runner import TorchBackend
from llmserve.sampling import SamplingParams

from test_torch_paged import BS, build_tiny_model, item, seq


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-graphs"))
    build_tiny_model(path)
    return path


def backend(path: str, kernel_ops: bool, graphs: bool) -> TorchBackend:
    b = TorchBackend(ServerConfig(model=path, dtype="float32", device="cpu", max_model_len=None, max_num_seqs=16),
                     TorchOptions.from_environ(cpu_kernels=False))
    b.load()
    b.init_kv_cache(KVCacheSpec(block_size=BS, num_blocks=160))
    if kernel_ops:  # the operators' CPU code stands in for the Triton kernels, as on CUDA
        c = b.cache
        b.cache = PagedKVCache(2, c.num_blocks, BS, c.kv_heads, c.head_dim, torch.float32, torch.device("cpu"),
                               native=False, kernel_ops=True)
        b._fused.ops, b._kernel = KernelOps(), True
    if graphs:
        assert b.enable_decode_graphs(eager_capture, max_model_len=64)
    return b


def test_buckets() -> None:
    assert buckets(1) == [1]
    assert buckets(20) == [1, 2, 4, 8, 16, 20]
    assert buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def test_graphed_steps_equal_eager_steps_over_changing_batches(tiny_dir: str) -> None:
    """50 steps: decode batches of changing size and order (replayed from the bucket above
    their size, spare rows padded), with prefill steps in between (eager): every token and
    logprob equals what the plain eager CPU backend computes for the same steps."""
    graphed, eager = backend(tiny_dir, True, True), backend(tiny_dir, False, False)
    rng = random.Random(7)
    seqs: dict[int, list[int]] = {}
    tables = {i: list(range(10 * i, 10 * i + 10)) for i in range(16)}
    greedy, sampled = SamplingParams(temperature=0, logprobs=2), SamplingParams(seed=11, temperature=0.8)
    for step in range(50):
        fresh = [i for i in range(16) if i not in seqs]
        if fresh and (step % 7 == 0 or len(seqs) < 2):  # a prefill step (eager in both)
            new = rng.sample(fresh, min(len(fresh), rng.randint(1, 3)))
            batch = [item(i, seq(100 + i, rng.randint(2, 9)), 0, tables[i], sampling=greedy) for i in new]
        else:
            live = [i for i in seqs if len(seqs[i]) < 38]
            pick = rng.sample(live, rng.randint(1, len(live)))
            batch = [item(i, [seqs[i][-1]], len(seqs[i]) - 1, tables[i], sampling=greedy if i % 3 else sampled)
                     for i in pick]
        a, b = graphed.step(batch), eager.step(batch)
        for it, ra, rb in zip(batch, a, b):
            assert ra.token_id == rb.token_id, f"step {step}, sequence {it.seq_id}"
            assert ra.logprob == pytest.approx(rb.logprob, abs=1e-4)
            if ra.top is not None:
                assert [t for t, _ in ra.top] == [t for t, _ in rb.top]
            seqs[it.seq_id] = (list(it.token_ids) if it.start_pos == 0 else seqs[it.seq_id]) + [ra.token_id]
    assert graphed._graphs.replayed >= 30 and graphed.steps == 50
    plan = graphed.plan()
    assert "cuda_graphs=5" in plan and "decode_attention=reference" in plan and "elementwise=triton" in plan
    assert "prefill_attention=reference" in plan


def test_a_step_that_does_not_fit_runs_eagerly(tiny_dir: str) -> None:
    b = backend(tiny_dir, True, True)
    a = seq(3, 6)
    b.step([item(0, a, 0, [0, 1, 2])])
    assert not b._graphs.fits([item(0, [a[-1]], 6, [0, 1, 2], prompt_logprob_targets=[])])
    assert not b._graphs.fits([item(0, [a[-1]], 64, list(range(20)))])   # past the table's width
    assert not b._graphs.fits([item(i, [a[-1]], 6, [0, 1, 2]) for i in range(17)])  # past the largest bucket
    assert b._graphs.fits([item(0, [a[-1]], 6, [0, 1, 2])])


def _meta_graphs(forward_extra=None) -> tuple[DecodeGraphs, int]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    fused = FusedDecoder.build(model)
    assert fused is not None
    cache = PagedKVCache(2, 32, BS, 2, 16, torch.float32, torch.device("meta"), native=False, kernel_ops=True)
    assert fused.tabulate_rope(64, torch.float32)

    def forward(ids, pos, meta):
        h = fused.forward(ids, pos, cache, meta)
        if forward_extra is not None:
            forward_extra(h)
        return model.lm_head(h).float()

    return DecodeGraphs(forward, 8, 16, BS, torch.device("meta"), cache.decode_segments), 128


def test_graphed_region_has_no_host_sync() -> None:
    """The whole graphed forward (embedding, RoPE lookup, norms, projections, the KV store and
    decode operators, the LM head) runs on meta tensors, where any read of a value on the host
    (``.item()``, ``.tolist()``, ``bool()``, ``nonzero``, a data-dependent shape) raises."""
    graphs, vocab = _meta_graphs()
    graphs.capture(eager_capture)
    out = graphs.run([item(i, [5], 9, [1, 2, 3]) for i in range(3)])
    assert out.shape == (3, vocab) and out.device.type == "meta"


@pytest.mark.parametrize("sync", [lambda h: h.sum().item(), lambda h: h.tolist(), lambda h: bool(h.any()),
                                  lambda h: h.nonzero()], ids=["item", "tolist", "bool", "nonzero"])
def test_the_meta_check_catches_a_sync(sync) -> None:
    graphs, _ = _meta_graphs(sync)
    with pytest.raises((RuntimeError, NotImplementedError)):
        graphs.capture(eager_capture)


class OpLog(TorchDispatchMode):
    """Every operator a region dispatches, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


NO_LAUNCH = {"aten.view.default", "aten.slice.Tensor", "aten.t.default", "aten.unsqueeze.default",
             "aten.detach.default", "aten.empty.memory_format"}


def layer_ops(ops) -> tuple[list[str], list[str]]:
    """The operators one decoder layer adds to a decode step (a 2-layer step less a 1-layer one),
    and those of them that launch work (not views or allocations)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    logs = []
    for layers in (1, 2):
        cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2)
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        fused = FusedDecoder.build(model, ops=ops)
        cache = PagedKVCache(layers, 32, BS, 2, 16, torch.float32, torch.device("meta"), native=False,
                             kernel_ops=True)
        fused.tabulate_rope(64, torch.float32)

        def m(*shape):
            return torch.empty(*shape, dtype=torch.int32, device="meta")

        meta = StepMetadata(slot_mapping=m(3), num_decode=3, decode_ctx=m(3), decode_table=m(3, 4))
        with OpLog() as log:
            fused.forward(m(3), m(3), cache, meta)
        logs.append(log.ops)
    extra = logs[1][len(logs[0]):]
    return extra, [op for op in extra if op not in NO_LAUNCH]


def test_op_count_per_layer_is_pinned() -> None:
    """With the kernel operators a decode layer launches 9 operations: four matrix products,
    two add + RMSNorm, RoPE + KV store, attention and SiLU-mul (torch's code launches 27)."""
    ours, launched = layer_ops(KernelOps())
    assert sorted(launched) == sorted(["aten.mm.default"] * 4 + ["llmserve.add_rms_norm.default"] * 2 + [
        "llmserve.rope_store.default", "llmserve.paged_decode.default", "llmserve.silu_mul.default"])
    assert len(ours) <= 21
    torch_all, torch_launched = layer_ops(TorchOps())
    assert len(torch_launched) >= 3 * len(launched)


def test_operators_serve_mixed_steps_and_cached_prefixes(tiny_dir: str) -> None:
    """Through the kernel operators (their CPU code), a step mixing decode rows with prompt chunks,
    one of which continues a cached prefix (read in place by ``paged_prefill``), gives the
    logits of the plain torch path."""
    ops_b, torch_b = backend(tiny_dir, True, False), backend(tiny_dir, False, False)
    a, c, e = seq(31, 17), seq(32, 6), seq(33, 9)
    steps = [
        [item(0, a[:10], 0, [0, 1, 2, 3, 4]), item(1, c[:5], 0, [8, 9])],
        [item(1, [c[5]], 5, [8, 9]), item(0, a[10:], 10, [0, 1, 2, 3, 4]), item(2, e, 0, [12, 13, 14])],
        [item(2, [7], 9, [12, 13, 14]), item(1, [9], 6, [8, 9])],
    ]
    for batch in steps:
        got, want = ops_b.forward_logits(batch), torch_b.forward_logits(batch)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
