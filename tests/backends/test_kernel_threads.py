"""The CPU kernels give the same logits whatever the thread count.

The suite's workers run one compute thread each (tests/conftest.py: two workers sharing two cores
run faster that way), so this module is where the kernels' split of rows, heads and sequences
over threads is held to the single-threaded result: tiny generated models on the native GGUF
path, a prefill then batched decode steps, at 1, 2 and 3 threads.
"""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from llmserve.config import ServerConfig
from llmserve.engine.backend import KVCacheSpec, StepItem
from llmserve.plugins.backends.torch.options import TorchOptions
from llmserve.plugins.backends.torch.runner import TorchBackend

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import gguf_writer

BS = 16
# Another split changes only the order of a few fp32 sums (where a kernel splits a reduction).
MAX_REL_DIFF = 1e-5


def logits_at(path: str, cache: str, threads: int, seqs: list[list[int]], prefill: int,
              **options: object) -> torch.Tensor:
    """Every sequence prefilled in one step, then decoded together a token per step."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        backend = TorchBackend(ServerConfig(model=path, dtype="float32", device="cpu", cache_dir=cache),
                               TorchOptions(**options))
        backend.info = backend.load()
        blocks = -(-len(seqs[0]) // BS)
        backend.init_kv_cache(KVCacheSpec(block_size=BS, num_blocks=blocks * len(seqs)))
        tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(len(seqs))]
        rows = [backend.forward_logits([StepItem(seq_id=i + 1, token_ids=ids[:prefill], start_pos=0,
                                                 block_table=tables[i])])[0] for i, ids in enumerate(seqs)]
        for p in range(prefill, len(seqs[0])):
            rows += backend.forward_logits([StepItem(seq_id=i + 1, token_ids=[ids[p]], start_pos=p,
                                                     block_table=tables[i]) for i, ids in enumerate(seqs)])
        return torch.cat(rows)
    finally:
        torch.set_num_threads(before)


CASES = {
    # K-quant matrices through the exact kernels; int8 decode activations; the fp32 matrices' own path.
    "llama-q4_k": ("llama", "Q4_K", {}, {"gguf_decode_activations": "fp32"}),
    "llama-q6_k-int8": ("llama", "Q6_K", {}, {"gguf_decode_activations": "int8"}),
    "llama-f32": ("llama", "F32", {}, {}),
    # Experts, sinks and sliding windows.
    "gpt-oss": ("gpt-oss", "Q8_0", {f"blk.{i}.ffn_{p}_exps.weight": "MXFP4" for i in range(2)
                                    for p in ("gate", "up", "down")}, {"gguf_decode_activations": "fp32"}),
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One metadata cache: files that differ only in their tensors' types share its entry."""
    return str(tmp_path_factory.mktemp("cache"))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_do_not_depend_on_the_thread_count(case: str, tmp_path, cache: str) -> None:
    arch, qtype, overrides, options = CASES[case]
    path = str(tmp_path / f"tiny-{case}.gguf")
    gguf_writer.write_tiny_gguf(path, arch, qtype, overrides=overrides)
    g = torch.Generator().manual_seed(3)
    # Seven sequences: more decode rows than threads, and a count no thread count divides.
    seqs = torch.randint(3, 49152, (7, 36), generator=g).tolist()
    one = logits_at(path, cache, 1, seqs, prefill=30, **options)
    for threads in (2, 3):
        got = logits_at(path, cache, threads, seqs, prefill=30, **options)
        diff = (got - one).abs().max().item() / one.abs().max().item()
        assert diff <= MAX_REL_DIFF, (threads, diff)
        assert torch.equal(got.argmax(-1), one.argmax(-1)), threads
