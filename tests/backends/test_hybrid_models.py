"""Hybrid models on the engine: Qwen3.5 (dense, MoE, and a whole multimodal checkpoint's language
model) and Qwen3-Next, whose Gated DeltaNet layers keep a recurrent state per sequence in the
backend's state slots, answer as transformers does: logits of one pass, of a prompt split at every
point, of sequences of different lengths decoding together, and greedy continuations alone, four
at once, in small prefill chunks and through preemption."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine.test_greedy_equality import MAX_NEW, proposer, run_engine
from transformers import PreTrainedTokenizerFast

from llmserve.config import ServerConfig
from llmserve.engine.backend import KVCacheSpec, StepItem
from llmserve.errors import ConfigError
from llmserve.plugins.backends.torch import deltanet
from llmserve.plugins.backends.torch.architectures import HYBRID, STATEFUL, UNFUSED_HYBRID, markdown_table
from llmserve.plugins.backends.torch.options import TorchOptions
from llmserve.plugins.backends.torch.runner import TorchBackend

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import hybrid_model

BS = 16
# Largest logit difference allowed against transformers, as a fraction of the largest logit (the
# logits spread ~8 and reach ~30: about 3e-3; float32 sums in another order, nothing more).
MAX_ERROR = 1e-4


# Token ids whose words the word tokenizer reads back as one token ("t107" would be "t1" + "07").
WORDS = [i for i in range(3, hybrid_model.VOCAB) if not str(i).startswith(("0", "1"))]


def ids_of(seed: int, n: int) -> list[int]:
    picks = torch.randint(0, len(WORDS), (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return [WORDS[i] for i in picks]


# Lengths: under the step form's limit, one chunk of the chunked form, and past two chunks.
PROMPTS = [ids_of(1, 5), ids_of(2, 23), ids_of(3, 70), ids_of(4, deltanet.CHUNK * 2 + 11)]


@dataclasses.dataclass
class Served:
    backend: TorchBackend
    info: object
    reference: torch.nn.Module
    path: str


# (shape, forward): every shape but the Mamba2 ones (Granite 4.0-H, Bamba, Nemotron-H) runs the
# fused forward (fused_hybrid.py); the dense Qwen3.5 text model, Qwen3-Next (grouped projections),
# LFM2 (short convolutions) and the Mamba2 ones transformers' forward with the recurrent layers replaced.
RUNS = [*[(name, "fused") for name in sorted(hybrid_model.SHAPES) if name not in UNFUSED_HYBRID],
        *[(name, "transformers") for name in ("qwen3_5_text", "qwen3_next", "lfm2", *sorted(UNFUSED_HYBRID))]]


@pytest.fixture(scope="module", params=RUNS, ids=[f"{name}-{forward}" for name, forward in RUNS])
def served(request, tmp_path_factory):
    name, forward = request.param
    path = str(tmp_path_factory.mktemp(name))
    reference = hybrid_model.write_hybrid(name, path)
    backend = TorchBackend(ServerConfig(model=path, dtype="float32", device="cpu"),
                           TorchOptions.from_environ(fused_forward=forward == "fused"))
    info = dataclasses.replace(backend.load(), tokenizer=PreTrainedTokenizerFast.from_pretrained(path))
    assert (forward == "fused") == (backend._fused is not None)
    yield Served(backend, info, reference, path)
    backend.close()


def fresh_cache(backend: TorchBackend, slots: int = 4, blocks: int = 64, saved: int = 0) -> None:
    backend.init_kv_cache(KVCacheSpec(block_size=BS, num_blocks=blocks, state_slots=slots, state_snapshots=saved))


def table(first: int, n: int) -> list[int]:
    return list(range(first, first + -(-n // BS)))


def close_to(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    error, scale = float((ours - ref).abs().max()), float(ref.abs().max())
    top1 = float((ours.argmax(-1) == ref.argmax(-1)).float().mean())
    assert error <= MAX_ERROR * scale and top1 >= 0.99, \
        f"{what}: max error {error:.2e} of logits up to {scale:.1f}, top-1 agreement {top1:.1%}"


def test_the_model_is_served_as_a_hybrid(served) -> None:
    be = served.backend
    fresh_cache(be, saved=2)
    assert served.info.state_bytes > 0
    kind, step = ("short-conv", "torch") if "lfm2" in served.path else ("mamba2", "torch") if any(
        name in served.path for name in UNFUSED_HYBRID) else ("gated-deltanet", "native")
    assert f"recurrent={kind}:3-layers,4-slots,2-saved,step={step}" in be.plan()
    assert be.cache.pool.shape[0] == 1, "only the full-attention layer keeps keys and values"


def test_one_pass_equals_transformers(served) -> None:
    be = served.backend
    fresh_cache(be)
    for slot, ids in enumerate(PROMPTS):
        ours = be.forward_logits([StepItem(seq_id=slot, token_ids=ids, start_pos=0, block_table=table(0, len(ids)),
                                           state_slot=slot)])[0]
        close_to(ours, hybrid_model.reference_logits(served.reference, ids), f"{len(ids)} tokens in one pass")


def test_a_prompt_split_at_every_point_equals_one_pass(served) -> None:
    be = served.backend
    fresh_cache(be, slots=2)
    ids = PROMPTS[1]
    ref = hybrid_model.reference_logits(served.reference, ids)
    for cut in range(1, len(ids)):
        parts = [be.forward_logits([StepItem(seq_id=0, token_ids=ids[a:b], start_pos=a, block_table=table(0, len(ids)),
                                             state_slot=1)])[0] for a, b in ((0, cut), (cut, len(ids)))]
        close_to(torch.cat(parts), ref, f"split at {cut}")
    # Three chunks, the middle one longer than a chunk of the chunked form.
    long = PROMPTS[3]
    cuts = [0, 3, 3 + deltanet.CHUNK + 5, len(long)]
    parts = [be.forward_logits([StepItem(seq_id=0, token_ids=long[a:b], start_pos=a, block_table=table(0, len(long)),
                                         state_slot=0)])[0] for a, b in zip(cuts, cuts[1:])]
    close_to(torch.cat(parts), hybrid_model.reference_logits(served.reference, long), "three chunks")


def test_sequences_of_different_lengths_decode_together(served) -> None:
    """Prompts of 5, 23 and 70 tokens prefill in one step (slots reused from a previous user),
    then decode four tokens side by side; every position's logits equal one pass over the whole."""
    be = served.backend
    fresh_cache(be, slots=3)
    seqs = [PROMPTS[0] + ids_of(10, 4), PROMPTS[1] + ids_of(11, 4), PROMPTS[2] + ids_of(12, 4)]
    tables = [table(0, 9), table(1, 27), table(3, 74)]
    be.forward_logits([StepItem(seq_id=9, token_ids=ids_of(5, 30), start_pos=0, block_table=table(8, 30),
                                state_slot=s) for s in range(3)])  # leave a used state in every slot
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    n = [len(p) for p in PROMPTS[:3]]
    first = be.forward_logits([StepItem(seq_id=i, token_ids=s[:n[i]], start_pos=0, block_table=tables[i],
                                        state_slot=2 - i) for i, s in enumerate(seqs)])
    for i, logits in enumerate(first):
        got[i].append(logits)
    for t in range(4):
        order = [2, 0, 1] if t % 2 else [0, 1, 2]  # the batch order changes; each row keeps its own slot
        outs = be.forward_logits([StepItem(seq_id=i, token_ids=[seqs[i][n[i] + t]], start_pos=n[i] + t,
                                           block_table=tables[i], state_slot=2 - i) for i in order])
        for i, logits in zip(order, outs):
            got[i].append(logits)
    for i, s in enumerate(seqs):
        close_to(torch.cat(got[i]), hybrid_model.reference_logits(served.reference, s), f"sequence {i}")


def test_greedy_continuations_equal_generate(served) -> None:
    want = {i: hybrid_model.reference_generate(served.reference, p, MAX_NEW) for i, p in enumerate(PROMPTS)}
    texts = [" ".join(f"t{t}" for t in p) for p in PROMPTS]
    pair = (served.backend, served.info)
    runs = {
        "alone": run_engine(pair, texts, sequential=True)[0],
        "four at once": run_engine(pair, texts)[0],
        "in 16-token steps": run_engine(pair, texts, max_num_batched_tokens=16)[0],
    }
    # The three shorter prompts start in a pool that cannot hold them all as they grow (11 blocks
    # at the end, 9 in the pool): the youngest are preempted and recompute their states.
    tight, engine = run_engine(pair, texts[:3], num_kv_blocks=9, max_model_len=9 * BS)
    runs["through preemption"] = tight
    assert engine.scheduler.num_preemptions_total > 0, "nothing was preempted"
    for name, got in runs.items():
        for i, text in enumerate(texts[:len(got)]):
            assert got[text] == want[i], f"{name}: prompt {i} answers {got[text]}, generate {want[i]}"


def test_a_state_saved_mid_chunk_resumes_in_another_slot(served) -> None:
    """A prompt chunk saves its state after 32 of its 50 tokens, in the same step as another
    sequence's 40-token prompt (the step's chunks run side by side, split at the save); another
    slot restores the saved state and goes on from there (keys and values of the first 32
    positions shared, as a prefix hit does): every logit equals one pass over the whole."""
    be = served.backend
    fresh_cache(be, slots=2, saved=3)
    ids, other = PROMPTS[2], ids_of(6, 40)
    ref = hybrid_model.reference_logits(served.reference, ids)
    tab = table(0, len(ids))
    first = be.forward_logits([StepItem(seq_id=0, token_ids=ids[:50], start_pos=0, block_table=tab, state_slot=0,
                                        state_snapshot=(32, 2)),
                               StepItem(seq_id=1, token_ids=other, start_pos=0, block_table=table(10, 40),
                                        state_slot=1)])  # slot 1 holds another sequence's state first
    close_to(first[0], ref[:50], "the chunk that saves its state")
    close_to(first[1], hybrid_model.reference_logits(served.reference, other), "the chunk beside it")
    rest = be.forward_logits([StepItem(seq_id=1, token_ids=ids[32:60], start_pos=32, block_table=tab, state_slot=1,
                                       state_restore=2)])[0]
    close_to(rest, ref[32:60], "resumed from the saved state")
    # Saved at the end of a decode row too.
    be.forward_logits([StepItem(seq_id=0, token_ids=ids[50:51], start_pos=50, block_table=tab, state_slot=0,
                                state_snapshot=(51, 0))])
    last = be.forward_logits([StepItem(seq_id=1, token_ids=ids[51:], start_pos=51, block_table=tab, state_slot=1,
                                       state_restore=0)])[0]
    close_to(last, ref[51:], "resumed after a decode row's save")
    with pytest.raises(ValueError, match="outside the fed positions"):
        be.forward_logits([StepItem(seq_id=0, token_ids=ids[:5], start_pos=0, block_table=tab, state_slot=0,
                                    state_snapshot=(9, 0))])


def test_a_prefix_hit_resumes_from_the_saved_state(served) -> None:
    """A conversation's second turn (the first turn's prompt, its answer and a new message) reuses
    the blocks and the state saved inside the first answer, and answers as transformers does
    without any reuse; the same prompt again reuses all but its last block."""
    from llmserve.engine.engine import LLMEngine
    from llmserve.request import PreparedRequest
    from llmserve.sampling import SamplingParams

    engine = LLMEngine(served.backend, served.info, ServerConfig(block_size=BS, num_kv_blocks=64, max_num_seqs=4))
    assert engine.block_manager.enable_prefix_caching and engine.block_manager.snapshots is not None

    def answer(ids: list[int], n: int = 8) -> tuple[list[int], int]:
        out: list[int] = []
        rid = f"r{engine.stats['steps']}"
        engine.add_request(PreparedRequest(prompt="", prompt_token_ids=tuple(ids), request_id=rid,
                                           sampling=SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)),
                           lambda o: out.extend(t for d in o.outputs for t in d.token_ids))
        hits = engine.block_manager.prefix_hit_tokens
        while engine.has_work:
            engine.step()
        return out, engine.block_manager.prefix_hit_tokens - hits

    first = PROMPTS[2]  # 70 tokens: its state is saved at 64, its answer's at 80
    reply, hit = answer(first, 20)
    assert hit == 0 and reply == hybrid_model.reference_generate(served.reference, first, 20)
    assert engine.block_manager.snapshots.num_saved == 2
    second = first + reply + ids_of(30, 9)
    reply2, hit = answer(second)
    assert hit == 80, f"the second turn reused {hit} tokens"
    assert reply2 == hybrid_model.reference_generate(served.reference, second, 8)
    again, hit = answer(second)
    assert hit == (len(second) - 1) // BS * BS and again == reply2
    assert engine.check_idle()


def test_admission_waits_for_a_state_slot(served) -> None:
    """Six requests, two slots: never more than two run, every answer equals its reference, and
    every slot is free at the end (run_engine's idle check)."""
    from llmserve.engine.engine import LLMEngine
    from llmserve.request import PreparedRequest
    from llmserve.sampling import SamplingParams

    prompts = [ids_of(20 + i, 6 + 5 * i) for i in range(6)]
    want = [hybrid_model.reference_generate(served.reference, p, 6) for p in prompts]
    engine = LLMEngine(served.backend, served.info, ServerConfig(block_size=BS, num_kv_blocks=64, max_num_seqs=2))
    assert engine.block_manager.state_slots.num_slots == 2
    got: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(PreparedRequest(prompt="", prompt_token_ids=tuple(p), request_id=str(i),
                                           sampling=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)),
                           lambda out, i=i: got.setdefault(i, []).extend(t for d in out.outputs for t in d.token_ids))
    most = 0
    while engine.has_work:
        engine.step()
        most = max(most, engine.snapshot().state_slots_used)
        engine.scheduler.check_invariants()
    assert most == 2
    assert [got[i] for i in range(6)] == want
    assert engine.check_idle() and engine.snapshot().state_slots_used == 0


def test_speculative_decoding_is_refused(served) -> None:
    from llmserve.engine.engine import LLMEngine

    config = ServerConfig(block_size=BS, num_kv_blocks=64, speculative_config={"method": "ngram"})
    with pytest.raises(ConfigError, match="recurrent state per sequence"):
        LLMEngine(served.backend, served.info, config, proposer(config, served.info))


def test_the_states_come_out_of_the_memory_budget(served) -> None:
    be = served.backend
    per_slot = served.info.state_bytes
    with pytest.raises(ConfigError, match="recurrent states of 1000000 sequences"):
        be.init_kv_cache(KVCacheSpec(block_size=BS, memory_fraction=1e-6, state_slots=1_000_000))
    fresh_cache(be, slots=5, saved=3)
    assert be.states.conv.shape[1] == be.states.ssm.shape[1] == 8
    held = (be.states.conv.numel() * be.states.conv.element_size() + be.states.ssm.numel() * 4)
    assert held == 8 * per_slot


def test_the_lists_and_the_docs_agree() -> None:
    assert not set(HYBRID) & set(STATEFUL)
    assert {shape for shape, _ in hybrid_model.SHAPES.values()} <= set(HYBRID)
    for arch in HYBRID:
        forward = "transformers' forward" if arch in UNFUSED_HYBRID else "fused forward"
        assert f"| `{arch}` | {forward}; its recurrent layers on the state slots |" in markdown_table()
    assert {name for name, forward in RUNS if forward == "fused"} == set(hybrid_model.SHAPES) - UNFUSED_HYBRID


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("Dk,Dv", [(16, 24), (32, 150)])
@pytest.mark.parametrize("kind", ["native", "avx2"])
def test_the_native_decode_rows_equal_the_torch_ones(tiled, Dk, Dv, kind) -> None:
    """The native kernel's decode rows (convolution, normalisation, delta rule, gated norm, the
    windows and states updated in place in the pools) equal the torch path's, for grouped and
    tiled key heads and three sequences in scattered slots (slot 0's saved after its step); state
    widths within one register chunk and across two with a partial vector (the AVX-512 delta
    rule's 128 columns at a time), and the build every AVX2 CPU runs."""
    from llmserve.plugins.backends.torch.native import build
    from llmserve.plugins.backends.torch.native.ops import DeltaNetDecode, deltanet_decode
    from llmserve.plugins.backends.torch.recurrent import (DeltaNetParams, DeltaNetShape, RecurrentStates, StateStep,
                                                           mix)

    if kind == "native":
        kernel = deltanet_decode()
    else:
        lib = build.baseline_library("deltanet_step", "Gated DeltaNet decode")
        kernel = DeltaNetDecode(lib) if lib is not None else None
    if kernel is None:
        pytest.skip("no C compiler here: the torch path is the only one")
    g = torch.Generator().manual_seed(3)
    Hk, Hv, K, B = 2, 6, 4, 3
    C = 2 * Hk * Dk + Hv * Dv
    p = DeltaNetParams(layer=0, conv=torch.randn(C, K, generator=g), neg_a=-torch.rand(Hv, generator=g) * 4,
                       dt_bias=torch.randn(Hv, generator=g), norm=torch.randn(Dv, generator=g), eps=1e-6,
                       key_heads=Hk, value_heads=Hv, key_dim=Dk, value_dim=Dv, tiled=tiled)
    y = torch.randn(B, C + Hv * Dv + 2 * Hv, generator=g)  # one projection: x, z, b, a side by side
    parts = (y[:, :C], y[:, C:C + Hv * Dv], y[:, C + Hv * Dv:C + Hv * Dv + Hv], y[:, C + Hv * Dv + Hv:])
    runs = []
    for native in (False, True):
        states = RecurrentStates(DeltaNetShape(C, K, Hv, Dk, Dv), [0], [1], 7, torch.float32, torch.device("cpu"),
                                 snapshots=2)
        states.conv.copy_(torch.randn(states.conv.shape, generator=torch.Generator().manual_seed(9)))
        states.ssm.copy_(torch.randn(states.ssm.shape, generator=torch.Generator().manual_seed(10)))
        states.decode_kernel = kernel if native else None
        st = StateStep(states, B, torch.tensor([5, 0, 3]), [(0, 7 + 1)], [])
        runs.append((mix(p, st, *parts), states.conv.clone(), states.ssm.clone()))
    for want, got in zip(runs[0], runs[1]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert torch.equal(runs[1][2][0, 8], runs[1][2][0, 0])  # the save: slot 0's state in saved state 1 (row 8)
