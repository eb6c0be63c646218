"""Tensor parallel on CUDA: two ranks on two GPUs over nccl give one GPU's logits and tokens."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from llmserve.engine.backend import KVCacheSpec, StepItem
from llmserve.plugins.backends.torch.factory import create
from llmserve.plugins.backends.torch.options import TorchOptions
from llmserve.sampling import SamplingParams

from .conftest import config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                  reason="needs CUDA with 2 GPUs")]


def test_two_gpus_match_one(tiny_6_3):
    greedy = SamplingParams(temperature=0)
    ref = create(config(tiny_6_3, 1, device="cuda"), TorchOptions())
    ref.load()
    ref.init_kv_cache(KVCacheSpec(4, num_blocks=16))
    tp = create(config(tiny_6_3, 2, device="cuda"), TorchOptions())
    try:
        tp.load()
        tp.init_kv_cache(KVCacheSpec(4, num_blocks=16))
        assert "tensor_parallel=2 (nccl)" in tp.plan()
        prefill = [StepItem(0, list(range(5, 19)), 0, [0, 1, 2, 3]), StepItem(1, [7, 8, 9], 0, [4])]
        for a, b in zip(ref.forward_logits(prefill), tp.forward_logits(prefill)):
            torch.testing.assert_close(b.float().cpu(), a.float().cpu(), rtol=2e-2, atol=2e-2)
        step = [StepItem(0, [3], 14, [0, 1, 2, 3], sampling=greedy), StepItem(1, [4], 3, [4], sampling=greedy)]
        assert [r.token_id for r in tp.step(step)] == [r.token_id for r in ref.step(step)]
    finally:
        tp.close()
