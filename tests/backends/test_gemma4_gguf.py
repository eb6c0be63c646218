"""Gemma 4 GGUF files (``gemma4``, as llama.cpp's converter writes them: per-layer arrays of
widths and key/value heads, the global layers' proportional RoPE as ``rope_freqs.weight``, the
per-layer embeddings, the experts beside the MLP) served in their own quantization on Gemma 4's
fused forward: F32 and Q8_0 files of the small models', the 31B's and the 26B-A4B's shapes answer
as transformers does on the weights they decode to, in one pass, in chunks and decoding token by
token; a file missing a tensor is refused at load in one line."""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from llmserve.config import ServerConfig
from llmserve.engine.backend import KVCacheSpec, StepItem
from llmserve.errors import ConfigError
from llmserve.plugins.backends.torch.fused_gemma4 import Gemma4Decoder
from llmserve.plugins.backends.torch.options import TorchOptions
from llmserve.plugins.backends.torch.runner import TorchBackend

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import gemma4_gguf
from hybrid_model import reference_generate, reference_logits

BS = 16
IDS = torch.randint(3, 40000, (70,), generator=torch.Generator().manual_seed(5)).tolist()
FILES = [("e2b", "F32"), ("moe", "F32"), ("dense", "F32"), ("e2b", "Q8_0"), ("moe", "Q8_0")]


def serve(path: str, tmp_path) -> TorchBackend:
    backend = TorchBackend(ServerConfig(model=path, device="cpu", dtype="float32", cache_dir=str(tmp_path / "cache")),
                           TorchOptions.from_environ())
    backend.load()
    backend.init_kv_cache(KVCacheSpec(block_size=BS, num_blocks=32))
    return backend


def logits(backend: TorchBackend, ids: list[int], cuts: tuple[int, ...] = (), seq: int = 0) -> torch.Tensor:
    edges = [0, *cuts, len(ids)]
    table = list(range(8 * seq, 8 * seq + 8))
    return torch.cat([backend.forward_logits([StepItem(seq_id=seq, token_ids=ids[a:b], start_pos=a,
                                                        block_table=table)])[0] for a, b in zip(edges, edges[1:])])


@pytest.mark.parametrize("name,qtype", FILES, ids=[f"{n}-{q}" for n, q in FILES])
def test_a_file_answers_as_transformers(name: str, qtype: str, tmp_path) -> None:
    path = str(tmp_path / f"tiny-gemma4-{name}-{qtype}.gguf")
    reference = gemma4_gguf.write_gemma4_gguf(path, name, qtype)
    backend = serve(path, tmp_path)
    try:
        assert isinstance(backend._fused, Gemma4Decoder)
        assert qtype.lower() in backend.plan().split("weights=gguf:")[1].split(",")
        ref = reference_logits(reference, IDS)
        for cuts in ((), (9, 40)):  # one pass; three chunks, past the windows
            ours = logits(backend, IDS, cuts)
            error, scale = float((ours - ref).abs().max()), float(ref.abs().max())
            assert error < 1e-4 * scale, f"chunks at {cuts}: max error {error:.2e} of logits up to {scale:.1f}"
            assert bool((ours.argmax(-1) == ref.argmax(-1)).all())
        want = reference_generate(reference, IDS[:20], 12)
        nxt, tokens = int(logits(backend, IDS[:20], seq=1)[-1].argmax()), []
        for pos in range(20, 32):  # decoding one token a step, from the file
            tokens.append(nxt)
            out = backend.forward_logits([StepItem(seq_id=1, token_ids=[nxt], start_pos=pos,
                                                   block_table=list(range(8, 16)))])[0]
            nxt = int(out[-1].argmax())
        assert tokens == want
    finally:
        backend.close()


@pytest.mark.parametrize("drop,words", [
    (("blk.2.attn_k.weight",), "lacks tensor blk.2.attn_k.weight"),
    (("per_layer_token_embd.weight",), "lacks tensor per_layer_token_embd.weight"),
    (("blk.1.layer_output_scale.weight",), "lacks tensor blk.1.layer_output_scale.weight"),
])
def test_a_file_missing_a_tensor_is_refused(drop: tuple[str, ...], words: str, tmp_path) -> None:
    path = str(tmp_path / "broken.gguf")
    gemma4_gguf.write_gemma4_gguf(path, "e2b", drop=drop)
    with pytest.raises(ConfigError) as err:
        serve(path, tmp_path)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_off_the_native_path_a_file_is_refused_in_one_line(tmp_path) -> None:
    """transformers' GGUF conversion cannot read a Gemma 4 file (its per-layer arrays): with the
    native path off, one line says where it is served."""
    path = str(tmp_path / "tiny.gguf")
    gemma4_gguf.write_gemma4_gguf(path, "dense")
    backend = TorchBackend(ServerConfig(model=path, device="cpu", dtype="float32", cache_dir=str(tmp_path / "cache")),
                           TorchOptions.from_environ(gguf_native=False))
    with pytest.raises(ConfigError) as err:
        backend.load()
    assert "gemma4 GGUF" in str(err.value) and "native CPU path" in str(err.value) and "\n" not in str(err.value)
