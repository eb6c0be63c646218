"""Speculative decoding in the engine: prompt-lookup proposals, their verification, block
accounting, and the sampled distribution (echo backend and a small Markov model)."""

from __future__ import annotations

import dataclasses
import math
import random
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))
from echo_backend import EchoBackend

from llmserve.config import ServerConfig, SpeculativeConfig
from llmserve.engine.backend import StepItem, StepResult
from llmserve.engine.engine import LLMEngine
from llmserve.engine.speculation import DraftRequest, Proposer, accept
from llmserve.errors import ConfigError
from llmserve.plugins.proposers.draft import DraftModelProposer
from llmserve.plugins.proposers.ngram import NgramProposer
from llmserve.request import PreparedRequest
from llmserve.sampling import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def make_engine(speculate: bool | dict = True, backend_cls: type = EchoBackend, proposer: Proposer | None = None,
                **cfg) -> LLMEngine:
    spec = (NGRAM if speculate is True else speculate) or None
    config = ServerConfig(block_size=4, num_kv_blocks=cfg.pop("num_kv_blocks", 256),
                          max_num_seqs=cfg.pop("max_num_seqs", 16), max_num_batched_tokens=64,
                          max_model_len=cfg.pop("max_model_len", 256), enable_prefix_caching=True,
                          speculative_config=spec, **cfg)
    backend = backend_cls(config)
    info = backend.load()
    if spec and proposer is None:
        proposer = NgramProposer(config.scheduler.speculative_config, info)
    return LLMEngine(backend, info, config, proposer)


def submit(engine: LLMEngine, rid: str, prompt: list[int], outputs: dict, **sampling) -> None:
    sampling.setdefault("temperature", 0)
    req = PreparedRequest(prompt="", prompt_token_ids=tuple(prompt), request_id=rid,
                          sampling=SamplingParams(**sampling))

    def sink(out, rid=rid):
        for d in out.outputs:
            key = rid if d.index == 0 else f"{rid}#{d.index}"
            entry = outputs.setdefault(key, {"ids": [], "text": "", "reason": None, "lps": []})
            entry["ids"] += d.token_ids
            entry["text"] += d.text
            entry["lps"] += [lp.logprob for lp in d.logprobs or []]
            if d.finish_reason:
                entry["reason"] = (d.finish_reason, d.stop_reason)
        if out.error is not None:
            outputs[f"{rid}!"] = str(out.error)
    engine.add_request(req, sink)


def drain(engine: LLMEngine) -> None:
    while engine.has_work:
        engine.step()
    assert engine.check_idle()


# Prompts whose echo (the echo model outputs its prompt) repeats what came before, and one whose
# lookups go wrong: "abXab" then "Y" follows the latest "ab", where the echo continues with "X".
PROMPTS = {
    "repeat": list(b"the cat sat on the mat; the cat sat on the mat; the cat sat on the hat."),
    "misleading": list(b"abXabYabZab-abXabYabZ"),
    "plain": list(b"no repeats here!"),
    "code": list(b"def f(x):\n    return x + 1\n\ndef g(x):\n    return x + 2\n"),
}
CASES = [({}, "plain"), ({"max_tokens": 7}, "max"), ({"stop": ["on the h"]}, "stop"),
         ({"stop": ["cat"], "include_stop_str_in_output": True}, "stop-in"), ({"n": 2}, "n"),
         ({"logprobs": 1}, "logprobs"), ({"stop_token_ids": [ord(";")]}, "stop-id"),
         ({"ignore_eos": True, "max_tokens": 90}, "ignore-eos")]


def run_all(speculate: bool | dict, **cfg) -> tuple[dict, LLMEngine]:
    engine = make_engine(speculate, **cfg)
    outputs: dict = {}
    for name, prompt in PROMPTS.items():
        for sampling, case in CASES:
            submit(engine, f"{name}/{case}", prompt, outputs, **sampling)
    drain(engine)
    return outputs, engine


def test_accept_keeps_proposals_up_to_the_first_disagreement() -> None:
    assert accept([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accept([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accept([5], [4, 5]) == 0
    assert accept([], [3]) == 0


def test_proposal_length_follows_acceptance_and_misses_back_off() -> None:
    from llmserve.engine.speculation import SpecTracker

    spec = SpecTracker(4)
    assert spec.k_for(1) == 1  # one at first
    spec.record(1, 1, 1)
    assert spec.k_for(1) == 2
    spec.record(1, 4, 2)
    assert spec.k_for(1) == 3  # one more than accepted
    spec.record(1, 3, 0)  # a miss: two plain steps, then one proposed
    assert [spec.k_for(1) for _ in range(3)] == [0, 0, 1]
    spec.record(1, 1, 0)  # a second miss in a row: four plain steps
    assert [spec.k_for(1) for _ in range(5)] == [0, 0, 0, 0, 1]
    spec.record(1, 1, 1)  # kept: the misses are forgotten
    assert spec.k_for(1) == 2
    for _ in range(10):
        spec.record(1, 1, 0)
    assert [spec.k_for(1) for _ in range(65)].count(0) == 64  # at most 64 plain steps
    spec.forget([1])
    assert spec.k_for(1) == 1 and spec.drafts == 15 and spec.accepted_tokens == 4


def test_outputs_equal_decoding_without_speculation() -> None:
    """Texts, token ids, finish reasons (stop strings, stop ids, max_tokens, EOS) and logprobs are
    those of plain decoding, in fewer steps; some proposals stood and some did not."""
    plain, plain_engine = run_all(False)
    fast, engine = run_all(True)
    assert fast == plain
    spec = engine.spec
    assert spec is not None and 0 < spec.accepted_tokens < spec.draft_tokens
    assert engine.stats["steps"] < plain_engine.stats["steps"]
    assert engine.stats["generation_tokens"] == plain_engine.stats["generation_tokens"]
    assert fast["repeat/max"]["reason"] == ("length", None) and len(fast["repeat/max"]["ids"]) == 7
    assert fast["repeat/stop"]["text"] == "the cat sat on the mat; the cat sat on the mat; the cat sat "
    stats = engine.snapshot()
    assert stats.spec_draft_tokens == spec.draft_tokens and sum(stats.spec_accepted_per_pos) == spec.accepted_tokens
    assert list(stats.spec_accepted_per_pos) == sorted(stats.spec_accepted_per_pos, reverse=True)


def test_chunked_prefill_preemption_and_a_small_pool() -> None:
    """A pool too small for the batch: sequences are preempted and recomputed, proposals that
    find no free block are dropped, and the outputs still equal plain decoding's."""
    plain, _ = run_all(False, num_kv_blocks=40, max_model_len=128)
    fast, engine = run_all(True, num_kv_blocks=40, max_model_len=128)
    assert fast == plain
    assert engine.scheduler.num_preemptions_total > 0 and engine.spec.accepted_tokens > 0


def test_aborts_mid_verification_leave_no_block_behind() -> None:
    engine = make_engine(max_num_seqs=32)
    outputs: dict = {}
    rng = random.Random(7)
    for i in range(60):
        submit(engine, f"r{i}", PROMPTS["repeat"][: rng.randint(10, 70)], outputs, ignore_eos=True, max_tokens=60)
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        engine.scheduler.check_invariants()
        if steps % 3 == 0:  # abort a few running ones, whatever they were doing
            for rid in rng.sample(sorted(engine.requests), k=min(3, len(engine.requests))):
                engine.abort(rid)
    assert engine.check_idle() and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.spec.drafts > 0 and not engine.proposer._index  # every sequence's index released


def test_a_request_may_opt_out_and_a_failing_proposer_costs_only_its_proposals(caplog) -> None:
    engine = make_engine()
    outputs: dict = {}
    submit(engine, "out", PROMPTS["repeat"], outputs, speculative=False)
    drain(engine)
    assert engine.spec.drafts == 0 and bytes(outputs["out"]["ids"][:-1]) == bytes(PROMPTS["repeat"])

    class Broken(Proposer):
        def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
            raise RuntimeError("proposer bug")

    engine = make_engine(proposer=Broken(SpeculativeConfig(**NGRAM), None))
    outputs = {}
    submit(engine, "a", PROMPTS["code"], outputs)
    drain(engine)
    assert bytes(outputs["a"]["ids"][:-1]) == bytes(PROMPTS["code"]) and "proposer bug" in caplog.text


def test_ngram_proposes_what_followed_the_longest_latest_match() -> None:
    proposer = NgramProposer(SpeculativeConfig(method="ngram", prompt_lookup_min=1, prompt_lookup_max=3), None)
    ask = [DraftRequest(1, [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3], k=3)]
    assert proposer.propose(ask) == [[7, 8, 5]]  # "5 2 3" never came before; "2 3" last ended at index 7
    assert proposer.propose([DraftRequest(2, [4, 5, 6, 4, 5], k=5)]) == [[6, 4, 5]]  # clipped at the end
    assert proposer.propose([DraftRequest(3, [1, 2, 3], k=2)]) == [[]]
    # Appending tokens extends the sequence's index; the latest occurrence wins.
    ids = [1, 2, 3, 9, 1, 2, 3, 7]
    proposer.propose([DraftRequest(4, ids, k=2)])
    ids += [1, 2, 3]
    assert proposer.propose([DraftRequest(4, ids, k=2)]) == [[7, 1]]
    proposer.release([1, 2, 3, 4])
    assert not proposer._index


@pytest.mark.parametrize(("given", "message"), [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min (5) exceeds"),
    ('{"method": "ngram", ', "not valid JSON"),
    ({"num_speculative_tokens": 3}, "method"),
])
def test_malformed_speculative_configs_are_refused(given, message) -> None:
    from llmserve.config import load_config

    with pytest.raises(ConfigError, match="speculative-config") as info:
        load_config({"speculative_config": given}, environ={})
    assert message in str(info.value) and "\n" not in str(info.value).strip()


def test_llama_cpp_draft_flags_fold_into_the_speculative_config() -> None:
    from llmserve.config import load_config

    config, _ = load_config({"spec_draft_model": "org/draft", "spec_draft_n_max": 5}, environ={})
    spec = config.scheduler.speculative_config
    assert (spec.method, spec.model_extra, spec.num_speculative_tokens) == ("draft", {"model": "org/draft"}, 5)
    config, _ = load_config({"speculative_config": '{"method": "draft"}'}, environ={"LLMSERVE_SPEC_DRAFT_MODEL": "d"})
    assert config.scheduler.speculative_config.model_extra == {"model": "d"}
    with pytest.raises(ConfigError, match="spec-draft-model names a draft model while speculative-config says"):
        load_config({"speculative_config": NGRAM, "spec_draft_model": "org/draft"}, environ={})
    with pytest.raises(ConfigError, match="spec-draft-n-max needs a method"):
        load_config({"spec_draft_n_max": 4}, environ={})


def test_no_proposals_while_more_sequences_run_than_disable_by_batch_size() -> None:
    """vLLM's ``disable_by_batch_size``: four prompts that echo the same length run together
    past the limit of three (nothing proposed), two stay under it; the draft method's own
    default on a CPU is one sequence."""
    counts = {}
    for n in (4, 2):
        engine = make_engine({**NGRAM, "disable_by_batch_size": 3})
        outputs: dict = {}
        prompt = list(b"abcabcabcabcabc")  # four fit one step's budget: they start together
        for i in range(n):
            submit(engine, f"r{i}", prompt, outputs, max_tokens=15)
        drain(engine)
        assert all(o["ids"] == prompt for o in outputs.values())
        counts[n] = engine.spec.drafts
    assert counts[4] == 0 and counts[2] > 0
    proposer, _ = draft_proposer(num_blocks=20, step_tokens=12)
    assert proposer.max_batch == 1


def test_a_method_setting_it_does_not_know_and_a_backend_that_cannot_verify() -> None:
    with pytest.raises(ConfigError, match="the ngram method has no setting 'model'"):
        make_engine({**NGRAM, "model": "draft-model"})

    class NoVerify(EchoBackend):
        verifies_drafts = False

    with pytest.raises(ConfigError, match="does not verify proposed tokens"):
        make_engine(backend_cls=NoVerify)


def follow(ids: list[int]) -> int:
    """The next token of ``Recurrence``'s model after ``ids``: a letter that depends on the last
    three tokens and the length."""
    return 97 + (sum(ids[-3:]) + 7 * len(ids)) % 26


class Recurrence(EchoBackend):
    """A draft model whose choice is ``follow`` of the tokens in its KV slots (not of the tokens
    it is told about), so a proposal made from a stale cache, or from the wrong position of a
    feed, shows; it records what it forgets."""

    def load(self):
        self.forgotten: list[int] = []
        return super().load()

    def step(self, batch: list[StepItem]) -> list[StepResult]:
        out = []
        for item in batch:
            for i, tok in enumerate(item.token_ids):
                self.slots[self._slot(item.block_table, item.start_pos + i)] = tok
            end = item.start_pos + len(item.token_ids)
            cached = [self.slots[self._slot(item.block_table, p)] for p in range(end)]
            if not item.sample:
                out.append(StepResult(item.seq_id))
                continue
            # As the contract says: a sample at each of the last num_draft_tokens + 1 positions.
            d = item.num_draft_tokens
            samples = [StepResult(item.seq_id, token_id=follow(cached[:end - d + j])) for j in range(d + 1)]
            out.append(dataclasses.replace(samples[0], draft_samples=samples[1:] or None))
        return out

    def release(self, seq_ids: list[int]) -> None:
        self.forgotten += seq_ids


def draft_proposer(num_blocks: int, step_tokens: int, **settings) -> tuple[DraftModelProposer, Recurrence]:
    config = ServerConfig(block_size=4, max_model_len=64)
    info = EchoBackend(config).load()
    draft = Recurrence(config)
    proposer = DraftModelProposer(SpeculativeConfig(method="draft", model="recurrence", **settings), info,
                                  lambda name: (draft, draft.load()))
    proposer.reserve(num_blocks, 4, step_tokens)
    return proposer, draft


def test_the_draft_model_proposes_from_a_cache_that_follows_each_sequence() -> None:
    """Three sequences grow as verification would grow them (some proposals stand, then the
    model's own token): every proposal is what the draft model says after the sequence's real
    tokens, a prompt longer than the step's budget is fed over several steps first, a pool too
    small for all of them takes the blocks of the one used longest ago, and every block comes
    back once the sequences leave."""
    proposer, draft = draft_proposer(num_blocks=20, step_tokens=12)
    rng = random.Random(7)
    seqs = {0: list(b"a prompt of twenty-two"), 1: list(b"short"), 2: list(b"mid-sized one")}
    proposed = caught_up = 0
    for _ in range(40):
        asked = [s for s in seqs if len(seqs[s]) < 56 and rng.random() < 0.8]
        wants = [DraftRequest(s, list(seqs[s]), rng.randint(1, 4), 5) for s in asked]
        for ask, got in zip(wants, proposer.propose(wants)):
            ids = seqs[ask.seq_id]
            expect: list[int] = []
            while len(expect) < len(got):
                expect.append(follow(ids + expect))
            assert got == expect and len(got) in (0, ask.k)
            proposed += len(got)
            caught_up += not got
            stood = rng.randint(0, len(got))
            ids += got[:stood] + [rng.randrange(32, 127)]
    assert proposed > 60 and caught_up > 0 and draft.forgotten  # proposals, catch-ups and evictions
    proposer.release(list(seqs))
    assert proposer.num_free_blocks == 20 and sorted(set(draft.forgotten)) == [0, 1, 2]


@pytest.mark.parametrize(("settings", "message"), [
    ({}, 'the draft method needs "model"'),
    ({"model": "recurrence", "prompt_lookup": 3}, "the draft method has no setting 'prompt_lookup'"),
])
def test_a_draft_method_without_its_model_or_with_a_setting_it_does_not_know(settings, message) -> None:
    info = EchoBackend(ServerConfig()).load()
    with pytest.raises(ConfigError, match=message):
        DraftModelProposer(SpeculativeConfig(method="draft", **settings), info, lambda name: None)


class MarkovBackend(EchoBackend):
    """A 4-token model whose next-token distribution depends on the last token only, sampled by
    the torch backend's sampler at every position it is asked for (proposals included)."""

    P = [[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25], [0.3, 0.1, 0.2, 0.4]]

    def load(self):
        from llmserve.plugins.backends.torch.sampler import Sampler

        info = super().load()
        self.sampler = Sampler(info.vocab_size, info.eos_token_ids)
        return info

    def step(self, batch: list[StepItem]) -> list[StepResult]:
        import dataclasses

        import torch

        rows, items, owner = [], [], []
        for i, it in enumerate(batch):
            for k, tok in enumerate(it.token_ids):
                self.slots[self._slot(it.block_table, it.start_pos + k)] = tok
            d = it.num_draft_tokens
            for j in range(d + 1):
                last = it.token_ids[len(it.token_ids) - 1 - d + j]
                row = torch.full((257,), -math.inf)
                row[:4] = torch.tensor(self.P[last % 4]).log()
                rows.append(row)
                drafts = it.token_ids[len(it.token_ids) - d:][:j]
                items.append(dataclasses.replace(it, output_ids=[*it.output_ids, *drafts]))
                owner.append(i)
        outs = self.sampler.sample(torch.stack(rows), items)
        results = [StepResult(it.seq_id) for it in batch]
        for i, o in zip(owner, outs):
            res = StepResult(batch[i].seq_id, token_id=o.token_id, logprob=o.logprob)
            if results[i].token_id is None:
                results[i] = res
            else:
                results[i].draft_samples = (results[i].draft_samples or []) + [res]
        return results


def test_sampled_output_follows_the_models_distribution() -> None:
    """Seeded random sampling with proposals verified: the joint distribution of the first three
    output tokens matches the model's (chi-square over the 64 outcomes, 6000 sequences), while
    most proposals of this repetitive little model are tried."""
    pytest.importorskip("torch")
    engine = make_engine({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                          "prompt_lookup_max": 2}, backend_cls=MarkovBackend, max_num_seqs=64)
    outputs: dict = {}
    prompt = [0, 1, 2, 3, 0, 1, 1, 2, 3]
    n = 6000
    for i in range(n):
        submit(engine, f"s{i}", prompt, outputs, temperature=1.0, seed=i, max_tokens=3, ignore_eos=True)
    drain(engine)
    seen = Counter(tuple(o["ids"]) for o in outputs.values())
    assert sum(seen.values()) == n and all(len(k) == 3 for k in seen)
    P, last = MarkovBackend.P, prompt[-1]
    chi2 = 0.0
    for a in range(4):
        for b in range(4):
            for c in range(4):
                expected = n * P[last][a] * P[a][b] * P[b][c]
                chi2 += (seen.get((a, b, c), 0) - expected) ** 2 / expected
    # 63 degrees of freedom: 103.4 is the 0.1% point. Seeds fix every draw, so this either
    # always passes or always fails.
    assert chi2 < 103.4, chi2
    assert engine.spec.draft_tokens > n // 2 and 0 < engine.spec.accepted_tokens < engine.spec.draft_tokens


def test_served_with_the_openai_client_streams_the_same_text(server_process) -> None:
    """``llmserve serve --speculative-config``: the ready line says so, a streamed completion's
    deltas add up to the plain answer (the prompt, from the echo backend), and /metrics counts
    the proposals."""
    import httpx
    import openai

    from conftest import ECHO_PLUGIN

    server = server_process("--backend", "echo", "--plugin", ECHO_PLUGIN, "--speculative-config",
                            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}')
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    prompt = "one two three, one two three, one two three, one two three."
    plain = client.completions.create(model="echo", prompt=prompt, max_tokens=80, temperature=0,
                                      extra_body={"speculative": False})
    parts = [c.choices[0].text for c in client.completions.create(model="echo", prompt=prompt, max_tokens=80,
                                                                  temperature=0, stream=True)]
    assert plain.choices[0].text == prompt == "".join(parts)
    assert len([p for p in parts if p]) < len(prompt)  # some deltas carried several verified tokens
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    accepted = next(line for line in metrics.splitlines()
                    if line.startswith("vllm:spec_decode_num_accepted_tokens_total"))
    assert float(accepted.rsplit(" ", 1)[1]) > 10
    assert "speculative decoding  ngram, up to 3 proposed tokens" in server.log


@pytest.mark.parametrize(("value", "message"), [
    ('{"method": "ngram", ', "error: invalid configuration: speculative-config: not valid JSON"),
    ('{"method": "nope"}', "error: unknown proposer 'nope'; available: draft, ngram"),
    ('{"method": "draft"}', "the draft method needs \"model\""),
    ('{"method": "ngram", "num_speculative_tokens": 99}', "speculative-config.num_speculative_tokens: Input should be"),
])
def test_bad_speculative_configs_stop_the_server_in_one_line(value: str, message: str) -> None:
    from conftest import ECHO_PLUGIN, run_cli

    out = run_cli("serve", "--backend", "echo", "--plugin", ECHO_PLUGIN, "--port", "0", "--speculative-config", value,
                  timeout=60)
    assert out.returncode != 0 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


class Countdown(Proposer):
    """A third-party proposer for the hook test: proposes ``k`` copies of the newest token."""

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        return [[r.token_ids[-1]] * r.k for r in requests]


def test_a_plugin_contributes_a_proposer_through_register_proposers(tmp_path) -> None:
    """A plugin file implementing ``register_proposers``: its proposer is listed beside the
    built-in one, picked by ``--speculative-config``'s method, and a server built with it
    answers as without it."""
    from fastapi.testclient import TestClient

    from conftest import ECHO_PLUGIN
    from llmserve import PluginManager, build_server
    from llmserve.config import load_config
    from llmserve.hooks.registry import Registry

    plugin = tmp_path / "repeat_plugin.py"
    plugin.write_text(
        "from llmserve import ProposerSpec, hookimpl\n\n\n"
        "@hookimpl\n"
        "def register_proposers():\n"
        f"    return [ProposerSpec(name='repeat-last', target='{Countdown.__module__}:Countdown')]\n")
    pm = PluginManager().load([(str(plugin), "cli")], autoload=False)
    registry = Registry.collect(pm)
    assert registry.names("proposer") == ["draft", "ngram", "repeat-last"]
    assert registry.load("proposer", "repeat-last") is Countdown
    config, _ = load_config({"backend": "echo", "plugins": [ECHO_PLUGIN, str(plugin)],
                             "speculative_config": {"method": "repeat-last"}}, environ={})
    app, _ = build_server(config, PluginManager().load(autoload=False))
    with TestClient(app, raise_server_exceptions=False) as client:
        reply = client.post("/v1/completions", json={"model": "echo", "prompt": "aaaabbbbccccdddd",
                                                     "max_tokens": 30, "temperature": 0})
        metrics = client.get("/metrics").text
    assert reply.json()["choices"][0]["text"] == "aaaabbbbccccdddd"
    accepted = next(ln for ln in metrics.splitlines() if ln.startswith("vllm:spec_decode_num_accepted_tokens_total"))
    assert float(accepted.rsplit(" ", 1)[1]) > 0
