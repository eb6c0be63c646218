"""Qwen3.5 and Qwen3-Next GGUF files (``qwen35``, ``qwen35moe`` and ``qwen3next``, as llama.cpp's
converter writes them: value heads in tiled order (Qwen3-Next's grouped, its ``b`` and ``a`` in one
tensor), query and gate rows interleaved, ``1 + weight`` norms, ``-exp(A_log)``; the MoE's experts
as 3-D tensors, gate and up apart or merged, and a shared expert) served in
their own quantization on the fused hybrid forward: an F32 file, and a Q8_0 one, answer as
transformers does on the weights they decode to, and a file with a missing or mis-shaped state
or expert tensor is refused at load with a line naming it."""

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


@pytest.fixture(scope="module", params=sorted(hybrid_model.GGUF_KINDS))
def f32_file(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}-F32.gguf")
    return path, hybrid_model.write_hybrid_gguf(path, "F32", kind=request.param)


def test_an_f32_file_answers_as_transformers(f32_file, tmp_path) -> None:
    path, reference = f32_file
    backend = serve(path, tmp_path)
    try:
        plan = backend.plan()
        assert "forward=fused" in plan and "weights=gguf:f32" in plan and "recurrent=gated-deltanet:3-layers" in plan
        ref = hybrid_model.reference_logits(reference, IDS)
        for cuts in ((), (7, 70)):  # one pass; three chunks, one past a chunk of the chunked form
            ours = logits(backend, IDS, cuts)
            error, scale = float((ours - ref).abs().max()), float(ref.abs().max())
            assert error < 1e-4 * scale, f"chunks at {cuts}: max error {error:.2e} of logits up to {scale:.1f}"
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
    # Off the native path, transformers would convert the file, which it cannot: one line says so.
    arch = os.path.basename(path).split("-")[1]
    off = TorchBackend(ServerConfig(model=path, device="cpu", dtype="float32", cache_dir=str(tmp_path / "cache")),
                       TorchOptions.from_environ(gguf_native=False))
    with pytest.raises(ConfigError, match=rf"is a {arch} GGUF, which transformers' GGUF conversion cannot read"):
        off.load()


@pytest.mark.parametrize("kind", ["qwen35", "qwen35moe"], ids=["qwen35", "qwen35moe-merged-experts"])
def test_a_q8_file_answers_as_transformers_on_its_decoded_weights(tmp_path, kind) -> None:
    path = str(tmp_path / "tiny-qwen35-Q8_0.gguf")
    reference = hybrid_model.write_hybrid_gguf(path, "Q8_0", kind=kind, merged=kind == "qwen35moe")
    backend = serve(path, tmp_path)
    try:
        assert "weights=gguf:f32,q8_0" in backend.plan() or "weights=gguf:q8_0" in backend.plan()
        # The reference holds the weights as the file decodes them: only arithmetic differs.
        ours, ref = logits(backend, IDS), hybrid_model.reference_logits(reference, IDS)
        assert float((ours - ref).abs().max()) < 1e-4 * float(ref.abs().max())
        assert bool((ours.argmax(-1) == ref.argmax(-1)).all())
    finally:
        backend.close()


@pytest.mark.parametrize("broken,value,says,kind", [
    ("blk.0.ssm_a", None, "qwen35 model", "qwen35"),                      # a Gated DeltaNet layer loses its state
    ("blk.1.ssm_conv1d.weight", np.zeros((7, 4), np.float32), "blk.1.ssm_conv1d.weight has 28 values", "qwen35"),
    ("blk.2.ssm_dt.bias", np.zeros(3, np.float32), "blk.2.ssm_dt.bias has 3 values", "qwen35"),
    ("blk.2.ssm_norm.weight", None, "lacks tensor blk.2.ssm_norm.weight", "qwen35"),
    ("blk.1.ssm_a", np.zeros(3, np.float32), "blk.1.ssm_a has 3 values where a qwen35moe", "qwen35moe"),
    ("blk.3.ffn_gate_inp_shexp.weight", None, "lacks tensor blk.3.ffn_gate_inp_shexp.weight", "qwen35moe"),
    ("blk.0.ffn_down_exps.weight", np.zeros((3, 64, 32), np.float32), "blk.0.ffn_down_exps.weight has shape",
     "qwen35moe"),
    ("blk.2.ssm_ba.weight", np.zeros((6, 64), np.float32), "blk.2.ssm_ba.weight is not 8 x 64", "qwen3next"),
    ("blk.0.ssm_dt.bias", None, "lacks tensor blk.0.ssm_dt.bias", "qwen3next"),
])
def test_a_file_with_a_missing_or_misshaped_state_tensor_is_refused(tmp_path, broken, value, says, kind) -> None:
    path = str(tmp_path / "broken-qwen35.gguf")
    hybrid_model.write_hybrid_gguf(path, "F32", replace={broken: value}, kind=kind)
    with pytest.raises(ConfigError, match=says):
        serve(path, tmp_path)


def test_an_lfm2_file_answers_as_transformers(tmp_path) -> None:
    path = str(tmp_path / "tiny-lfm2-F32.gguf")
    reference = hybrid_model.write_lfm2_gguf(path)
    backend = serve(path, tmp_path)
    try:
        plan = backend.plan()
        assert "forward=fused" in plan and "weights=gguf:f32" in plan and "recurrent=short-conv:3-layers" in plan
        ref = hybrid_model.reference_logits(reference, IDS)
        for cuts in ((), (1, 2, 50)):  # one pass; chunks shorter than the convolution's window
            ours = logits(backend, IDS, cuts)
            assert float((ours - ref).abs().max()) < 1e-4 * float(ref.abs().max()), f"chunks at {cuts}"
            assert bool((ours.argmax(-1) == ref.argmax(-1)).all())
    finally:
        backend.close()
    # transformers' conversion would drop the convolution biases: refused off the native path.
    off = TorchBackend(ServerConfig(model=path, device="cpu", dtype="float32", cache_dir=str(tmp_path / "cache")),
                       TorchOptions.from_environ(gguf_native=False))
    with pytest.raises(ConfigError, match="has short-convolution biases, which transformers' GGUF conversion drops"):
        off.load()


def test_an_lfm2_file_without_convolution_biases_converts_as_well(tmp_path) -> None:
    """Off the native path (--no-torch-gguf-native) an LFM2 file as the Hub's are (no biases) is
    converted to an fp32 copy and answers the same."""
    path = str(tmp_path / "tiny-lfm2-F32.gguf")
    reference = hybrid_model.write_lfm2_gguf(path, replace={f"blk.{i}.shortconv.conv.bias": None for i in range(3)})
    with torch.no_grad():
        for layer in reference.model.layers[:3]:
            layer.conv.conv.bias.zero_()
    backend = TorchBackend(ServerConfig(model=path, device="cpu", dtype="float32", cache_dir=str(tmp_path / "cache")),
                           TorchOptions.from_environ(gguf_native=False))
    backend.load()
    backend.init_kv_cache(KVCacheSpec(block_size=BS, num_blocks=32, state_slots=2, state_snapshots=1))
    try:
        assert "weights=gguf" not in backend.plan() and "recurrent=short-conv:3-layers" in backend.plan()
        ours, ref = logits(backend, IDS, (30,)), hybrid_model.reference_logits(reference, IDS)
        assert float((ours - ref).abs().max()) < 1e-4 * float(ref.abs().max())
    finally:
        backend.close()


@pytest.mark.parametrize("broken,value,says", [
    ("blk.0.shortconv.conv.weight", np.zeros((64, 2), np.float32), "blk.0.shortconv.conv.weight has 128 values"),
    ("blk.1.shortconv.in_proj.weight", None, "lacks tensor blk.1.shortconv.in_proj.weight"),
    ("blk.2.shortconv.conv.bias", np.zeros(3, np.float32), "blk.2.shortconv.conv.bias has 3 values"),
])
def test_an_lfm2_file_with_a_missing_or_misshaped_convolution_is_refused(tmp_path, broken, value, says) -> None:
    path = str(tmp_path / "broken-lfm2.gguf")
    hybrid_model.write_lfm2_gguf(path, replace={broken: value})
    with pytest.raises(ConfigError, match=says):
        serve(path, tmp_path)
