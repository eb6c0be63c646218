"""The int8 KV cache (``--kv-cache-dtype int8``, also ``q8_0`` and ``fp8``): rows quantized as they
are written (int8 codes, an fp32 scale per 32), read in place by the native decode and prefill
kernels; the pool sized in its bytes; greedy agreement and logit error against the fp32 and
bf16 caches at the documented bounds; refused where the native kernels do not run."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from llmserve.config import ServerConfig
from llmserve.engine.backend import KVCacheSpec, StepItem
from llmserve.errors import ConfigError
from llmserve.plugins.backends.torch import runner
from llmserve.plugins.backends.torch.attention import PagedKVCache, kv_cache_dtype, row_width
from llmserve.plugins.backends.torch.options import TorchOptions
from llmserve.plugins.backends.torch.runner import TorchBackend

CPU = torch.device("cpu")


def dequantized(pool: torch.Tensor, D: int) -> torch.Tensor:
    """An int8 pool's rows as fp32: codes times their group's scale."""
    scales = pool[..., D:].contiguous().view(torch.float32).repeat_interleave(32, -1)[..., :D]
    return pool[..., :D].float() * scales


def filled_cache(kvh: int, D: int, bs: int, T: int, seed: int) -> tuple[PagedKVCache, list[int], torch.Tensor]:
    """An int8 cache with T positions of random keys and values written through the kernel,
    in scattered blocks; returns it, the block table and the fp32 keys and values written."""
    gen = torch.Generator().manual_seed(seed)
    nblocks = -(-T // bs) + 6
    cache = PagedKVCache(1, nblocks, bs, kvh, D, torch.int8, CPU, native=True)
    table = torch.randperm(nblocks, generator=gen)[:-(-T // bs)].tolist()
    kv = torch.randn(2, T, kvh, D, generator=gen) * torch.linspace(0.5, 4.0, D)   # uneven channels
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(T)])
    cache.write_kv(cache.layers[0][1], slots, kv[0], kv[1])
    return cache, table, kv


@pytest.mark.parametrize("D", [64, 40, 128])
def test_each_row_is_quantized_per_group_of_32(D: int) -> None:
    kvh, bs, T = 2, 16, 37
    cache, table, kv = filled_cache(kvh, D, bs, T, seed=D)
    assert cache.pool.shape[-1] == row_width(D, torch.int8) == D + 4 * -(-D // 32)
    deq = dequantized(cache.layers[0][0], D)
    for p in (0, 15, 16, 36):
        got = deq[:, table[p // bs], p % bs]                                    # [2 * kvh, D]
        want = torch.cat([kv[0, p], kv[1, p]])
        for g0 in range(0, D, 32):  # within half a step of each group's own scale
            group = want[:, g0:g0 + 32]
            step = group.abs().amax(-1, keepdim=True) / 127
            assert bool(((got[:, g0:g0 + 32] - group).abs() <= step / 2 + 1e-6).all())
    cache.write_kv(cache.layers[0][1], torch.tensor([table[0] * bs]), torch.zeros(1, kvh, D), torch.zeros(1, kvh, D))
    assert bool((dequantized(cache.layers[0][0], D)[:, table[0], 0] == 0).all())   # an all-zero row stays zero


@pytest.mark.parametrize("G,window", [(4, None), (3, 50), (1, None)])
def test_decode_and_prefill_read_the_codes(G: int, window: int | None) -> None:
    """Both kernels equal float64 attention over the dequantized rows: the codes are read in
    place, converted block by block, with nothing lost beyond the quantization itself."""
    kvh, D, bs, T = 2, 64, 16, 203
    cache, table, _ = filled_cache(kvh, D, bs, T, seed=G)
    blocks_view = cache.layers[0][0]
    deq = dequantized(blocks_view, D).double()
    pos = torch.arange(T)
    blk = torch.tensor(table)[pos // bs]
    keys, vals = deq[:kvh, blk, pos % bs], deq[kvh:, blk, pos % bs]
    gen = torch.Generator().manual_seed(9)
    H, scale = kvh * G, D ** -0.5

    def attend(q: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        allowed = pos[None, :] <= q_pos[:, None]
        if window:
            allowed &= pos[None, :] > q_pos[:, None] - window
        return torch.stack([torch.softmax((q[:, h].double() @ keys[h // G].T * scale).masked_fill(~allowed, -torch.inf),
                                          -1) @ vals[h // G] for h in range(H)], 1)

    q = torch.randn(1, H, D, generator=gen)
    out = torch.empty(1, H, D)
    cache.decode_kernel(q, blocks_view, torch.tensor(table), torch.tensor([T]), out, scale, window)
    torch.testing.assert_close(out.double(), attend(q, torch.tensor([T - 1])), atol=1e-5, rtol=1e-5)
    q = torch.randn(T - 50, H, D, generator=gen)                 # a chunk after a 50-token prefix
    out = torch.empty(T - 50, H, D)
    cache.prefill_kernel(q, blocks_view, cache.plan_prefill([(0, T - 50, 50, table)]), out, scale, window)
    torch.testing.assert_close(out.double(), attend(q, torch.arange(50, T)), atol=1e-5, rtol=1e-5)


def test_the_names_of_an_8_bit_cache() -> None:
    for name in ("int8", "q8_0", "fp8", "FP8_E4M3", "fp8_e5m2"):
        assert kv_cache_dtype(name, torch.float32) == torch.int8
    with pytest.raises(ValueError, match="use auto, float32, bfloat16, float16 or int8"):
        kv_cache_dtype("int4", torch.float32)


def test_refused_where_the_native_kernels_do_not_run(tmp_path) -> None:
    with pytest.raises(ValueError, match="native CPU kernels"):
        PagedKVCache(1, 4, 16, 2, 64, torch.int8, CPU, native=False)
    backend = TorchBackend(ServerConfig(model=None, dtype="float32", device="cpu", max_model_len=256,
                                        kv_cache_dtype="q8_0"), TorchOptions(threads=1, cpu_kernels=False))
    backend.load()
    with pytest.raises(ConfigError, match="--kv-cache-dtype q8_0: the int8 KV cache is read by the native CPU kernels"):
        backend.init_kv_cache(KVCacheSpec(block_size=16, num_blocks=32))
    backend.close()


def test_the_pool_is_sized_in_its_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same memory holds 3.56x the fp32 cache's blocks (72 bytes a row of 64 against 256)."""
    blocks = {}
    for kv in ("float32", "int8"):
        backend = TorchBackend(ServerConfig(model=None, dtype="float32", device="cpu", max_model_len=256,
                                            kv_cache_dtype=kv), TorchOptions(threads=1))
        backend.load()
        per_block = PagedKVCache.bytes_per_block(backend._num_layers, 16, backend._kv_heads, backend._head_dim,
                                                 kv_cache_dtype(kv, torch.float32))
        monkeypatch.setattr(runner, "_available_cpu_memory", lambda: 7200 * 1024 * 30)
        blocks[kv] = backend.init_kv_cache(KVCacheSpec(block_size=16, memory_fraction=0.5))
        assert blocks[kv] == 7200 * 1024 * 30 // 2 // per_block
        assert f"kv_dtype={kv} " in backend.plan()
        backend.close()
    assert blocks["int8"] * 72 // 256 in range(blocks["float32"] - 1, blocks["float32"] + 2)


def prompt_logits(kv: str, ids: list[int], chunk: int) -> torch.Tensor:
    """The embedded SmolLM2's logits at every position of ``ids`` through a cache of ``kv``,
    prefilled in chunks (later chunks read the earlier ones from the cache)."""
    backend = TorchBackend(ServerConfig(model=None, dtype="float32", device="cpu", max_model_len=len(ids) + 16,
                                        kv_cache_dtype=kv), TorchOptions())
    backend.load()
    backend.init_kv_cache(KVCacheSpec(block_size=16, num_blocks=len(ids) // 16 + 4))
    table = list(range(len(ids) // 16 + 1))
    out = [backend.forward_logits([StepItem(seq_id=1, token_ids=ids[s:s + chunk], start_pos=s, block_table=table,
                                            sample=False)])[0] for s in range(0, len(ids), chunk)]
    backend.close()
    return torch.cat(out)


@pytest.fixture(scope="module")
def long_prompt_logits() -> dict[str, torch.Tensor]:
    ids = torch.randint(100, 49000, (1536,), generator=torch.Generator().manual_seed(0)).tolist()
    return {kv: prompt_logits(kv, ids, 512) for kv in ("float32", "bfloat16", "int8")}


def test_accuracy_on_a_long_prompt(long_prompt_logits: dict[str, torch.Tensor]) -> None:
    """The bounds docs/engine.md states, on SmolLM2 over a 1536-token prompt: the next-token
    choice agrees with the fp32 cache's at >= 96% of positions (bf16: >= 99%), the mean logit
    error stays under 0.07 (bf16: under 0.03), every logit within 25% of the largest."""
    fp32 = long_prompt_logits["float32"]
    for kv, agree, mean in (("bfloat16", 0.99, 0.03), ("int8", 0.96, 0.07)):
        got = long_prompt_logits[kv]
        err = (got - fp32).abs()
        assert float((got.argmax(-1) == fp32.argmax(-1)).float().mean()) >= agree, kv
        assert float(err.mean()) < mean, kv
        assert float(err.max()) <= 0.25 * float(fp32.abs().max()), kv


def decode_logits(native_step: bool, kv: str = "int8") -> torch.Tensor:
    """SmolLM2: a 40-token prefill, then five decode steps of two sequences; the decode logits."""
    backend = TorchBackend(ServerConfig(model=None, dtype="float32", device="cpu", max_model_len=128,
                                        kv_cache_dtype=kv), TorchOptions(native_step=native_step))
    backend.load()
    backend.init_kv_cache(KVCacheSpec(block_size=16, num_blocks=16))
    ids = torch.randint(100, 49000, (2, 45), generator=torch.Generator().manual_seed(1)).tolist()
    tables = [[0, 1, 2], [5, 4, 3]]
    backend.forward_logits([StepItem(seq_id=i, token_ids=ids[i][:40], start_pos=0, block_table=tables[i],
                                     sample=False) for i in range(2)])
    out = [torch.cat(backend.forward_logits([StepItem(seq_id=i, token_ids=[ids[i][p]], start_pos=p,
                                                      block_table=tables[i], sample=False) for i in range(2)]))
           for p in range(40, 45)]
    assert (backend._fused.native_step(backend.cache) is not None) == native_step
    backend.close()
    return torch.stack(out)


def test_decode_steps_read_the_int8_cache() -> None:
    """The one-call native decode step runs the int8 write and attention kernels and gives the
    layer loop's logits bit for bit; both stay near the fp32 cache's."""
    native, loop = decode_logits(True), decode_logits(False)
    assert torch.equal(native, loop)
    fp32 = decode_logits(True, "float32")
    assert float((native - fp32).abs().max()) <= 0.25 * float(fp32.abs().max())
    assert float((native.argmax(-1) == fp32.argmax(-1)).float().mean()) >= 0.8
