"""Acceptance: greedy output through the engine equals transformers' generate(do_sample=False).

Real embedded SmolLM2, fp32, CPU. Run alone, all in one batch, without prefix caching, with
chunked prefill splitting long prompts, and under forced preemption (a pool too small for the
batch). A divergence is tolerated only at a genuine near-tie (reference logprobs of both
tokens within 1e-3 there), at most one prompt in 20 per run.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from llmserve.config import ServerConfig

torch = pytest.importorskip("torch")

MAX_NEW = 24
BASE = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "List three primary colors:",
    "Water boils at",
    "The quick brown fox",
    "In 1969, astronauts",
    "A haiku about autumn:\n",
    "Translate to French: Good morning, how are you?",
    "The mitochondria is",
    "1, 2, 3, 4,",
    "Q: What is 12 times 12?\nA:",
    "import numpy as np\n\nx =",
    "The best way to learn a language is",
    "Dear hiring manager,",
    "Photosynthesis converts",
    "Rain is falling on the",
    "Recipe: pancakes. Ingredients:",
]
LONG = ("Here is a long passage about the history of computing. " * 12 + "In summary,",
        "Notes from the meeting: " + "the team discussed budgets, timelines and hiring. " * 10 + "Next steps:")
PROMPTS = BASE + list(LONG)


@pytest.fixture(scope="module")
def model_dir():
    from llmserve.plugins.backends.torch.loader import hf_directory

    return hf_directory(None)


def batched_greedy(model, encoded: list[list[int]], pad: int, eos: list[int] | None = None,
                   **generate: object) -> list[list[int]]:
    """transformers' greedy ``generate`` over the prompts ``encoded`` as one left-padded batch:
    a decode step reads the fp32 weights once for all of them (per prompt it takes ~3x as long
    here); the attention mask, and the positions generate derives from it, keep each row what
    it is alone. A row is cut after its first ``eos`` token (the batch pads the rows that ended)."""
    width = max(map(len, encoded))
    ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=pad,
                             **({"eos_token_id": eos} if eos else {}), **generate)
    rows = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if eos and t in eos), len(row))
        rows.append(row[:end])
    return rows


@pytest.fixture(scope="module")
def reference(model_dir):
    """Token ids from HF generate with the stock attention, plus the model for tie checks."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    rows = batched_greedy(model, [tok(p).input_ids for p in PROMPTS], tok.eos_token_id, max_new_tokens=MAX_NEW,
                          min_new_tokens=MAX_NEW)
    return SimpleNamespace(tok=tok, model=model, outputs=dict(zip(PROMPTS, rows)))


def near_tie(reference, prompt: str, prefix: list[int], ours: int) -> bool:
    ids = reference.tok(prompt).input_ids + prefix
    with torch.inference_mode():
        logits = reference.model(torch.tensor([ids])).logits[0, -1].float()
    lp = torch.log_softmax(logits, -1)
    ref = reference.outputs[prompt][len(prefix)]
    return abs(float(lp[ref] - lp[ours])) <= 1e-3


@pytest.fixture(scope="module")
def backend(model_dir):
    """One loaded model for every engine configuration below (each engine re-sizes the KV pool)."""
    from llmserve.plugins.backends.torch.runner import TorchBackend

    be = TorchBackend(ServerConfig(model=model_dir, dtype="float32", device="cpu", max_model_len=1024,
                                   enforce_eager=True))
    info = be.load()
    return be, info


class Wrong:
    """A draft backend whose choices are wrong where they are a multiple of five (a fifth of
    them: each one's proposal is rejected and the draft's cache must drop it)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step(self, batch):
        results = self.inner.step(batch)
        for r in results:
            for sample in (r, *(r.draft_samples or ())):
                if sample.token_id is not None and sample.token_id % 5 == 0:
                    sample.token_id += 1
        return results


@pytest.fixture(scope="module")
def draft_backend():
    """The embedded GGUF, the file the fp32 model was converted from, loaded again as a draft
    model: its greedy choices are the model's, but for the ones ``Wrong`` alters."""
    from llmserve.plugins.backends.torch.loader import embedded_model_path
    from llmserve.plugins.backends.torch.runner import TorchBackend

    be = TorchBackend(ServerConfig(model=embedded_model_path(), device="cpu", max_model_len=1024))
    return Wrong(be), be.load()


def proposer(config, info, draft=None):
    """The built-in proposer ``--speculative-config`` names: ``ngram`` (prompt lookup), or
    ``draft`` with ``draft`` as the model its loader returns."""
    from llmserve.plugins.proposers.draft import DraftModelProposer
    from llmserve.plugins.proposers.ngram import NgramProposer

    spec = config.scheduler.speculative_config
    if spec.method == "draft":
        return DraftModelProposer(spec, info, lambda name: draft)
    return NgramProposer(spec, info)


def run_engine(backend, prompts, passes=1, sequential=False, speculate=False, draft=None, **cfg):
    from llmserve.engine.engine import LLMEngine
    from llmserve.request import PreparedRequest
    from llmserve.sampling import SamplingParams

    be, info = backend
    if "max_model_len" in cfg:  # a shorter context lets a tiny pool pass the capacity check
        info = dataclasses.replace(info, max_model_len=cfg.pop("max_model_len"))
    config = ServerConfig(block_size=16, num_kv_blocks=cfg.pop("num_kv_blocks", 256),
                          max_num_seqs=cfg.pop("max_num_seqs", 32),
                          max_num_batched_tokens=cfg.pop("max_num_batched_tokens", 2048),
                          enable_prefix_caching=cfg.pop("enable_prefix_caching", True),
                          enable_chunked_prefill=True,
                          speculative_config=({"method": "draft", "model": "embedded", "disable_by_batch_size": 64}
                                              if draft else {"method": "ngram"}) | {"num_speculative_tokens": 4}
                          if speculate else None,
                          **cfg)
    engine = LLMEngine(be, info, config, proposer(config, info, draft) if speculate else None)
    results: dict[str, list[int]] = {}
    for n in range(passes):
        results = {}
        for p in prompts:
            ids = engine.tokenizer(p).input_ids
            req = PreparedRequest(prompt=p, prompt_token_ids=tuple(ids), request_id=f"{n}:{p}",
                                  sampling=SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
            engine.add_request(req, lambda out, p=p, results=results: results.setdefault(p, []).extend(
                t for d in out.outputs for t in d.token_ids))
            while sequential and engine.has_work:  # alone: finish it before the next one starts
                engine.step()
        while engine.has_work:
            engine.step()
        assert engine.check_idle()
    return results, engine


def check(reference, results) -> None:
    ties = []
    for p, ours in results.items():
        ref = reference.outputs[p]
        if ours == ref:
            continue
        at = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
        assert near_tie(reference, p, ref[:at], ours[at]), f"{p!r} diverges at token {at}: {ours[at]} vs {ref[at]}"
        ties.append(p)
    assert len(ties) <= 1, f"near-ties in {len(ties)} prompts: {ties}"
    assert len(results) == len(reference.outputs)


def test_batched_equals_reference(backend, reference):
    results, _ = run_engine(backend, PROMPTS)
    check(reference, results)


def test_each_prompt_alone_equals_reference(backend, reference):
    results, engine = run_engine(backend, PROMPTS, sequential=True, enable_prefix_caching=False)
    check(reference, results)


def test_prefix_caching_off_and_on_with_shared_prefixes(backend, reference):
    off, engine = run_engine(backend, PROMPTS, enable_prefix_caching=False)
    check(reference, off)
    assert engine.block_manager.prefix_hit_tokens == 0
    # A second pass on the same engine reuses the first pass's blocks (the long prompts'
    # full blocks at least) and must still match the reference token for token.
    second, engine = run_engine(backend, PROMPTS, passes=2)
    check(reference, second)
    assert engine.block_manager.prefix_hit_tokens >= 2 * 16 * 7


def test_chunked_prefill_splits_long_prompts(backend, reference):
    results, engine = run_engine(backend, PROMPTS, max_num_batched_tokens=64)
    check(reference, results)
    assert engine.stats["steps"] > MAX_NEW + 5  # long prompts took several chunks


def test_forced_preemption(backend, reference):
    # 20 sequences needing ~65 blocks at their longest share a 24-block pool: some must be
    # evicted and recomputed, several times over.
    results, engine = run_engine(backend, PROMPTS, num_kv_blocks=24, max_model_len=256)
    check(reference, results)
    assert engine.scheduler.num_preemptions_total > 0


def test_speculative_decoding_equals_reference(backend, reference):
    """Prompt-lookup proposals, verified by the model in the same batch: the same tokens, with
    preemption too; the proposals that stood are what the counters say."""
    results, engine = run_engine(backend, PROMPTS, speculate=True)
    check(reference, results)
    spec = engine.spec
    assert spec.drafts > 0 and 0 < spec.accepted_tokens <= spec.draft_tokens
    results, engine = run_engine(backend, PROMPTS, speculate=True, num_kv_blocks=24, max_model_len=256)
    check(reference, results)
    assert engine.scheduler.num_preemptions_total > 0 and engine.spec.accepted_tokens > 0


def test_a_draft_model_proposing_equals_reference(backend, draft_backend, reference):
    """A draft model proposes (a fifth of its choices wrong): the same tokens, with chunked
    prefill and with preemption too; most proposals stand, some do not, and the draft's pool is
    whole again once the sequences left."""
    results, engine = run_engine(backend, PROMPTS, speculate=True, draft=draft_backend, max_num_batched_tokens=64)
    check(reference, results)
    spec = engine.spec
    assert spec.accepted_tokens > spec.draft_tokens / 2 and spec.accepted_tokens < spec.draft_tokens
    assert engine.proposer.num_free_blocks == 256
    results, engine = run_engine(backend, PROMPTS, speculate=True, draft=draft_backend, num_kv_blocks=24,
                                 max_model_len=256)
    check(reference, results)
    assert engine.scheduler.num_preemptions_total > 0 and engine.spec.accepted_tokens > 0
    assert engine.proposer.num_free_blocks == 24


def test_a_verifying_step_samples_each_position_as_plain_decoding_would(backend):
    """The torch backend's side of the contract, with strong penalties: a step fed the newest
    token and four proposals (the tokens plain decoding went on to pick) samples at each position
    what plain decoding picked there, the proposals before it counted as output."""
    from llmserve.engine.backend import KVCacheSpec, StepItem
    from llmserve.sampling import SamplingParams

    be, info = backend
    be.init_kv_cache(KVCacheSpec(block_size=16, num_blocks=32))
    sp = SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=2.0, presence_penalty=2.0)
    prompt = info.tokenizer("1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,").input_ids
    table = list(range(8))
    out = [be.step([StepItem(0, prompt, 0, table, sampling=sp, prompt_ids=prompt)])[0].token_id]
    for _ in range(5):  # plain decoding, one token a step
        out.append(be.step([StepItem(0, [out[-1]], len(prompt) + len(out) - 1, table, sampling=sp,
                                     prompt_ids=prompt, output_ids=list(out))])[0].token_id)
    verify = StepItem(0, out[:5], len(prompt), table, sampling=sp, prompt_ids=prompt, output_ids=out[:1],
                      num_draft_tokens=4)
    result = be.step([verify])[0]
    assert [result.token_id, *(r.token_id for r in result.draft_samples)] == out[1:6]
    # Without the proposals counted as output the penalties would have let the model repeat itself.
    unpenalised = StepItem(0, out[:5], len(prompt), table, sampling=sp, prompt_ids=prompt, output_ids=out[:1])
    logits = be.forward_logits([unpenalised])[0]
    assert [int(t) for t in logits.argmax(-1)[:5]] != out[1:6]
