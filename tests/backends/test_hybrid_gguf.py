"""Qwen3.5 GGUF files (``qwen35``, as llama.cpp's converter writes them: value heads in tiled order,
query and gate rows interleaved, ``1 + weight`` norms, ``-exp(A_log)``) served in their own
quantization on the fused hybrid forward: an F32 file, and a Q8_0 one, answer as transformers does
on the weights they decode to, and a file with a missing or mis-shaped state tensor is
refused at load with a line naming it."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from llmserve.config import ServerConfig
from llmserve.engine.backend import KVCacheSpec, StepItem
from llmserve.errors import ConfigError
from llmserve.plugins.backends.torch.options import TorchOptions
from llmserve.plugins.backends.torch.runner import TorchBackend

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import hybrid_model

BS = 16
IDS = torch.randint(3, 40000, (90,), generator=torch.Generator().manual_seed(5)).tolist()


def serve(path: str, tmp_path) -> TorchBackend:
    backend = TorchBackend(ServerConfig(model=path, device="cpu", dtype="float32", cache_dir=str(tmp_path / "cache")),
                           TorchOptions.from_environ())
    backend.load()
    backend.init_kv_cache(KVCacheSpec(block_size=BS, num_blocks=32, state_slots=2, state_snapshots=1))
    return backend


def logits(backend: TorchBackend, ids: list[int], cuts: tuple[int, ...] = ()) -> torch.Tensor:
    edges = [0, *cuts, len(ids)]
    return torch.cat([backend.forward_logits([StepItem(seq_id=0, token_ids=ids[a:b], start_pos=a,
                                                        block_table=list(range(8)), state_slot=0)])[0]
                      for a, b in zip(edges, edges[1:])])


@pytest.fixture(scope="module")
def f32_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen35") / "tiny-qwen35-F32.gguf")
    return path, hybrid_model.write_hybrid_gguf(path, "F32")


def test_an_f32_file_answers_as_transformers(f32_file, tmp_path) -> None:
    path, reference = f32_file
    backend = serve(path, tmp_path)
    try:
        plan = backend.plan()
        assert "forward=fused" in plan and "weights=gguf:f32" in plan and "recurrent=gated-deltanet:3-layers" in plan
        ref = hybrid_model.reference_logits(reference, IDS)
        for cuts in ((), (7, 70)):  # one pass; three chunks, one past a chunk of the chunked form
            ours = logits(backend, IDS, cuts)
            assert float((ours - ref).abs().max()) < 2e-3, f"chunks at {cuts}"
            assert bool((ours.argmax(-1) == ref.argmax(-1)).all())
        # Greedy decoding from the file equals transformers' generate.
        want = hybrid_model.reference_generate(reference, IDS[:20], 12)
        tokens, fed = [], IDS[:20]
        backend.forward_logits([StepItem(seq_id=1, token_ids=fed, start_pos=0, block_table=[9, 10, 11],
                                         state_slot=1)])
        nxt = int(logits(backend, IDS[:20])[-1].argmax())
        for pos in range(20, 32):
            tokens.append(nxt)
            out = backend.forward_logits([StepItem(seq_id=0, token_ids=[nxt], start_pos=pos,
                                                   block_table=list(range(8)), state_slot=0)])[0]
            nxt = int(out[-1].argmax())
        assert tokens == want
    finally:
        backend.close()


def test_a_q8_file_answers_as_transformers_on_its_decoded_weights(tmp_path) -> None:
    path = str(tmp_path / "tiny-qwen35-Q8_0.gguf")
    reference = hybrid_model.write_hybrid_gguf(path, "Q8_0")
    backend = serve(path, tmp_path)
    try:
        assert "weights=gguf:f32,q8_0" in backend.plan() or "weights=gguf:q8_0" in backend.plan()
        # The reference holds the weights as the file decodes them: only arithmetic differs.
        ours, ref = logits(backend, IDS), hybrid_model.reference_logits(reference, IDS)
        assert float((ours - ref).abs().max()) < 2e-3
        assert bool((ours.argmax(-1) == ref.argmax(-1)).all())
    finally:
        backend.close()


@pytest.mark.parametrize("broken,value,says", [
    ("blk.0.ssm_a", None, "qwen35 model"),                                 # a Gated DeltaNet layer loses its state
    ("blk.1.ssm_conv1d.weight", np.zeros((7, 4), np.float32), "blk.1.ssm_conv1d.weight has 28 values"),
    ("blk.2.ssm_dt.bias", np.zeros(3, np.float32), "blk.2.ssm_dt.bias has 3 values"),
    ("blk.2.ssm_norm.weight", None, "lacks tensor blk.2.ssm_norm.weight"),
])
def test_a_file_with_a_missing_or_misshaped_state_tensor_is_refused(tmp_path, broken, value, says) -> None:
    path = str(tmp_path / "broken-qwen35.gguf")
    hybrid_model.write_hybrid_gguf(path, "F32", replace={broken: value})
    with pytest.raises(ConfigError, match=says):
        serve(path, tmp_path)
