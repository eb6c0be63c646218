"""Tensor parallel on tiny random models (gloo, CPU): the refusal, and logits equal to one rank's."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from llmserve.engine.backend import KVCacheSpec, StepItem
from llmserve.errors import ConfigError
from llmserve.plugins.backends.torch.factory import create
from llmserve.plugins.backends.torch.options import TorchOptions
from llmserve.plugins.backends.torch.runner import TorchBackend
from llmserve.plugins.backends.torch.tensor_parallel import TensorParallelBackend
from llmserve.sampling import SamplingParams

from .conftest import config

GREEDY = SamplingParams(temperature=0)


def test_a_size_the_heads_do_not_take_is_refused_before_any_worker_starts(tiny_4_2):
    import psutil

    backend = create(config(tiny_4_2, 3), TorchOptions())
    assert isinstance(backend, TensorParallelBackend)
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 3 cannot split .*4 attention heads \(2 KV heads\)"):
        backend.load()
    assert not [p for p in psutil.Process().children() if "spawn" in " ".join(p.cmdline())]


def test_a_hybrid_model_is_refused_before_any_worker_starts(tmp_path):
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    import hybrid_model

    hybrid_model.write_hybrid("qwen3_5", str(tmp_path))
    with pytest.raises(ConfigError, match="is a .qwen3_5_text. model; tensor parallel runs the Llama-style decoders"):
        create(config(str(tmp_path), 2), TorchOptions()).load()


def test_embedding_task_refuses_tensor_parallel():
    with pytest.raises(ConfigError, match="generation models"):
        create(config(None, 2, task="embed"), TorchOptions())


def batches() -> list[list[StepItem]]:
    prefill = [StepItem(0, list(range(5, 19)), 0, [0, 1, 2, 3]), StepItem(1, [7, 8, 9], 0, [4])]
    decode = [StepItem(0, [3], 14, [0, 1, 2, 3]), StepItem(1, [4], 3, [4])]
    # A prefill chunk over cached positions next to a decode row.
    mixed = [StepItem(1, [11], 4, [4, 5]), StepItem(0, [20, 21, 22, 23, 24], 15, [0, 1, 2, 3, 6])]
    return [prefill, decode, mixed]


@pytest.mark.parametrize("world", [3, 2])
def test_logits_and_greedy_tokens_match_one_rank(tiny_6_3, world):
    ref = TorchBackend(config(tiny_6_3, 1), TorchOptions())
    ref.load()
    ref.init_kv_cache(KVCacheSpec(4, num_blocks=16))
    tp = create(config(tiny_6_3, world), TorchOptions())
    try:
        tp.load()
        tp.init_kv_cache(KVCacheSpec(4, num_blocks=16))
        assert f"tensor_parallel={world} (gloo)" in tp.plan()
        for batch in batches():
            for a, b in zip(ref.forward_logits(batch), tp.forward_logits(batch)):
                assert a.shape == b.shape
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        step = [StepItem(0, [30], 20, [0, 1, 2, 3, 6, 7], sampling=GREEDY),
                StepItem(1, [31], 5, [4, 5], sampling=GREEDY, prompt_logprob_targets=[])]
        want, got = ref.step(step), tp.step(step)
        assert [r.token_id for r in got] == [r.token_id for r in want]
        assert got[0].logprob == pytest.approx(want[0].logprob, abs=1e-4)
        assert tp.reduce_s > 0
    finally:
        tp.close()
    assert not tp._procs
