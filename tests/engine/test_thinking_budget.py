"""Thinking budgets in the engine (``llmserve.engine.budget``): the tracker's counting and forcing
rules alone, then the engine forcing the end marker on a model whose reasoning never ends, on
the torch backend (a generated Llama, ``tests/thinking_model.py``) and on the native GGUF path
(a generated Q8_0 GGUF, whose tokenizer spells ``</think>`` in several tokens)."""

from __future__ import annotations

import pytest

from llmserve.config import ServerConfig
from llmserve.engine.budget import DONE, FORCE, THINK, WAIT, BudgetTracker
from llmserve.request import PreparedRequest, ReasoningBudget
from llmserve.sampling import SamplingParams
from thinking_model import build_thinking_model

END = (7,)


def budget(tokens: int, **more: object) -> ReasoningBudget:
    fields: dict = {"end": "</think>", "end_ids": END, "start": "<think>", "opened": True, **more}
    return ReasoningBudget(tokens=tokens, **fields)


def run(tracker: BudgetTracker, pieces: list[tuple[int, str]]) -> list[int | None]:
    """Feed ``(token, text)`` pieces; the forced token before each (None: free)."""
    forced = []
    for token, text in pieces:
        allowed = tracker.allowed([])
        forced.append(allowed[0] if allowed else None)
        tracker.on_token(allowed[0] if allowed else token, text)
    return forced


# -- the tracker's rules ---------------------------------------------------------------------
def test_an_opened_reasoning_is_forced_shut_at_the_budget():
    t = BudgetTracker(budget(3))
    assert t.phase == THINK
    forced = run(t, [(1, " a"), (1, " b"), (1, " c"), (1, " d"), (1, " e")])
    assert forced == [None, None, None, 7, None]
    assert t.phase == DONE and t.count == 3


def test_the_note_counts_against_the_budget_and_is_dropped_when_it_cannot_fit():
    t = BudgetTracker(budget(4, message_ids=(5, 6)))
    assert run(t, [(1, " a"), (1, " b"), (1, "x"), (1, "y"), (1, "z"), (1, "w")]) == [None, None, 5, 6, 7, None]
    assert t.count == 4
    small = BudgetTracker(budget(1, message_ids=(5, 6)))
    assert run(small, [(1, " a"), (1, " b"), (1, " c")]) == [None, 7, None] and small.count == 1


def test_a_budget_of_zero_forces_the_end_marker_first():
    t = BudgetTracker(budget(0, end_ids=(7, 8)))
    assert t.phase == FORCE and run(t, [(1, "</"), (1, "think>"), (1, " a")]) == [7, 8, None]
    assert t.count == 0 and t.phase == DONE


def test_a_model_that_closes_its_reasoning_in_time_is_left_alone():
    t = BudgetTracker(budget(5))
    assert run(t, [(1, " a"), (1, "</th"), (1, "ink>"), (1, " b"), (1, " c"), (1, " d")]) == [None] * 6
    assert t.phase == DONE and t.count == 1  # " a": the tokens holding the marker are not reasoning


def test_without_an_opened_prompt_the_budget_counts_from_the_start_marker():
    t = BudgetTracker(budget(2, opened=False))
    assert t.phase == WAIT
    assert run(t, [(1, "\n"), (1, "<thi"), (1, "nk>"), (1, " a"), (1, " b"), (1, " c")]) == [None] * 5 + [7]
    assert t.count == 2


def test_an_answer_without_thinking_is_never_steered():
    t = BudgetTracker(budget(1, opened=False))
    assert run(t, [(1, " <"), (1, "b>hello"), (1, " a"), (1, " b")]) == [None] * 4 and t.phase == DONE


def test_a_parser_that_reads_unmarked_output_as_reasoning_counts_it_from_the_first_token():
    t = BudgetTracker(budget(3, opened=False, default_open=True))
    assert run(t, [(1, " Let"), (1, " me"), (1, " think"), (1, " more"), (1, " now")]) == [None] * 3 + [7, None]
    assert t.count == 3
    marked = BudgetTracker(budget(2, opened=False, default_open=True))
    assert run(marked, [(1, "<think>"), (1, " a"), (1, " b"), (1, " c")]) == [None] * 3 + [7]


def test_tokens_that_hold_only_the_end_marker_are_not_reasoning():
    t = BudgetTracker(budget(50))
    run(t, [(1, "L"), (1, "e"), (1, "t"), *((1, c) for c in "</think>"), (1, "A")])
    assert t.phase == DONE and t.count == 3


def test_a_forced_token_the_sampler_did_not_honour_stops_the_steering():
    t = BudgetTracker(budget(0, end_ids=(7, 8)))
    t.on_token(9, "x")
    assert t.phase == DONE and t.allowed([]) is None


# -- the engine --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    pytest.importorskip("torch")
    from llmserve.plugins.backends.torch.runner import TorchBackend

    path = build_thinking_model(str(tmp_path_factory.mktemp("thinker")))
    backend = TorchBackend(ServerConfig(model=path, dtype="float32", device="cpu", max_model_len=512))
    return backend, backend.load()


def generate(backend, info, requests: list[PreparedRequest], **cfg: object) -> dict:
    """Run ``requests`` to the end: ``request id -> (token ids, text, usage.reasoning_tokens)``;
    ``"preemptions"`` -> how many times the scheduler preempted a sequence."""
    import dataclasses

    from llmserve.engine.engine import LLMEngine

    if "max_model_len" in cfg:  # a shorter context lets a tiny pool pass the capacity check
        info = dataclasses.replace(info, max_model_len=cfg.pop("max_model_len"))
    config = ServerConfig(block_size=16, num_kv_blocks=cfg.pop("num_kv_blocks", 64), max_num_seqs=8, **cfg)
    engine = LLMEngine(backend, info, config)
    outs: dict[str, list] = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add_request(r, outs[r.request_id].append)
    while engine.has_work:
        engine.step()
    assert engine.check_idle()
    result = {}
    for rid, events in outs.items():
        assert events[-1].finished and events[-1].error is None
        ids = [t for e in events for d in e.outputs for t in d.token_ids]
        result[rid] = (ids, "".join(d.text for e in events for d in e.outputs), events[-1].usage.reasoning_tokens)
    result["preemptions"] = engine.scheduler.num_preemptions_total
    return result


def chat_request(info, rid: str, max_tokens: int, reasoning: ReasoningBudget | None, **sampling: object):
    tok = info.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "w1 w2 w3"}], tokenize=False,
                                     add_generation_prompt=True)
    return PreparedRequest(request_id=rid, prompt=prompt, prompt_token_ids=tuple(tok.encode(prompt)),
                           sampling=SamplingParams(**{"temperature": 0, "max_tokens": max_tokens, **sampling}),
                           reasoning_budget=reasoning)


def test_the_engine_ends_a_never_ending_reasoning_at_the_budget(thinker):
    backend, info = thinker
    end = info.tokenizer.convert_tokens_to_ids("</think>")
    spec = {"end": "</think>", "end_ids": (end,), "start": "<think>", "opened": True}
    note = tuple(info.tokenizer.encode("w7 w8"))
    requests = [chat_request(info, "free", 60, None),
                chat_request(info, "b16", 60, ReasoningBudget(tokens=16, **spec)),
                chat_request(info, "b0", 10, ReasoningBudget(tokens=0, **spec)),
                chat_request(info, "note", 40, ReasoningBudget(tokens=10, message_ids=note, **spec)),
                chat_request(info, "n2", 30, ReasoningBudget(tokens=5, **spec), n=2)]
    out = generate(backend, info, requests)
    free_ids, free_text, free_count = out["free"]
    assert out["preemptions"] == 0
    assert len(free_ids) == 60 and end not in free_ids and free_count is None  # it never ends by itself
    ids, text, count = out["b16"]
    assert ids[16] == end and ids.count(end) == 1 and count == 16
    assert ids[:16] == free_ids[:16]  # the budget changes nothing before it is spent
    assert text.split("</think>")[1].strip()  # then an answer
    ids, _, count = out["b0"]
    assert ids[0] == end and count == 0
    ids, text, count = out["note"]
    assert ids[8:11] == [*note, end] and count == 10 and "w7 w8 </think>" in text
    ids, _, count = out["n2"]
    assert count == 10 and ids.count(end) == 2  # each sequence has its own budget, counted in the sum


def test_preemption_keeps_the_budget(thinker):
    """A pool too small for both sequences: one is preempted and recomputed, its budget kept."""
    backend, info = thinker
    end = info.tokenizer.convert_tokens_to_ids("</think>")
    spec = ReasoningBudget(tokens=20, end="</think>", end_ids=(end,), start="<think>", opened=True)
    requests = [chat_request(info, f"r{i}", 40, spec) for i in range(3)]
    out = generate(backend, info, requests, num_kv_blocks=8, max_model_len=64)
    assert out.pop("preemptions") > 0
    for ids, _, count in out.values():
        assert ids[20] == end and ids.count(end) == 1 and count == 20


def test_the_native_gguf_path_forces_a_marker_spelled_in_several_tokens(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    import gguf_writer
    from llmserve.plugins.backends.torch.options import TorchOptions
    from llmserve.plugins.backends.torch.runner import TorchBackend

    path = str(tmp_path / "tiny.gguf")
    gguf_writer.write_tiny_gguf(path, "llama", "Q8_0", hidden=128, inter=256)
    backend = TorchBackend(ServerConfig(model=path, dtype="float32", device="cpu", max_model_len=256,
                                        cache_dir=str(tmp_path / "cache")), TorchOptions())
    info = backend.load()
    assert "gguf" in backend.plan().lower()
    tok = info.tokenizer
    end_ids = tuple(tok.encode("</think>", add_special_tokens=False))
    assert len(end_ids) > 1
    spec = ReasoningBudget(tokens=12, end="</think>", end_ids=end_ids, opened=True)
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    ids = tuple(tok.encode(prompt))
    requests = [PreparedRequest(request_id=rid, prompt=prompt, prompt_token_ids=ids, reasoning_budget=b,
                                sampling=SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
                for rid, b in (("free", None), ("budget", spec))]
    out = generate(backend, info, requests)
    free_ids, free_text, _ = out["free"]
    assert "</think>" not in free_text
    got, text, count = out["budget"]
    assert got[:12] == free_ids[:12] and tuple(got[12:12 + len(end_ids)]) == end_ids and count == 12
    assert text.count("</think>") == 1 and text.split("</think>")[1]
