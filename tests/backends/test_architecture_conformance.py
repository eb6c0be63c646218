"""Architecture conformance: every architecture the torch backend serves answers as transformers does,
and every one it cannot serve right is refused at start.

For each verified ``model_type`` (``architectures.VERIFIED``) a tiny random-weight model is built
from its config (2 layers, hidden 64, fp32) and served by the engine; its greedy continuations must
equal transformers' ``generate`` on the same weights token for token: each prompt alone, four
requests at once, a prompt longer than every sliding window, and that prompt again from the prefix
cache. The fused forward's architectures run both forwards. The families whose layers keep a
recurrent or convolution state are refused by ``llmserve serve`` with one line and exit code 2.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
from dataclasses import dataclass
from typing import Iterator

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import ROOT
from transformers import PreTrainedTokenizerFast
from engine.test_greedy_equality import MAX_NEW, run_engine
from test_startup import one_line_error
from test_torch_paged import VOCAB, save_word_tokenizer

from llmserve.config import ModelConfig, ServerConfig
from llmserve.engine.backend import KVCacheSpec, StepItem
from llmserve.errors import ConfigError
from llmserve.plugins.backends.torch import architectures
from llmserve.plugins.backends.torch.architectures import FUSED, STATEFUL, VERIFIED
from llmserve.plugins.backends.torch.loader import load_model
from llmserve.plugins.backends.torch.options import TorchOptions
from llmserve.plugins.backends.torch.runner import OWN_FORWARDS, TorchBackend

WINDOW = 8  # every windowed tiny model's sliding window: the long prompt crosses it several times
PAD = 2     # t0 is the BOS, t1 the EOS, t2 the padding
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.2,
              tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=PAD)
SLIDING = dict(sliding_window=WINDOW)
MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
MHA = dict(num_key_value_heads=4)  # architectures without GQA: a stray num_key_value_heads would mislead the cache
# model_type -> what its tiny config sets beyond COMMON (windows, experts, multipliers).
TINY: dict[str, dict] = {
    "llama": {},
    "mistral": SLIDING,
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                  layer_types=["full_attention", "sliding_attention"]),
    "mixtral": {**MOE, **SLIDING},
    "qwen2_moe": dict(MOE, shared_expert_intermediate_size=64),
    "qwen3": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                  layer_types=["full_attention", "sliding_attention"]),
    "qwen3_moe": MOE,
    "gemma": {},
    "gemma2": dict(SLIDING, attn_logit_softcapping=None, final_logit_softcapping=30.0, query_pre_attn_scalar=16),
    "gemma3_text": dict(SLIDING, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16),
    # Global layers of one 32-wide head whose keys are its values, the last two layers reading the first two's
    # keys and values (the wider MLP there), per-layer embeddings, proportional RoPE on a quarter of each head.
    "gemma4_text": dict(SLIDING, num_hidden_layers=4, global_head_dim=32, num_global_key_value_heads=1,
                        attention_k_eq_v=True, num_kv_shared_layers=2, use_double_wide_mlp=True,
                        hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                        final_logit_softcapping=30.0,
                        layer_types=["sliding_attention", "full_attention"] * 2),
    "phi3": {},
    "olmo2": {},
    "olmo": {},
    "olmoe": MOE,
    "olmo3": dict(SLIDING, layer_types=["sliding_attention", "full_attention"]),
    "granite": dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.25, logits_scaling=2.0),
    "granitemoe": dict(MOE, logits_scaling=2.0),
    "granitemoeshared": dict(MOE, shared_intermediate_size=64),
    "cohere": dict(logit_scale=0.5),
    "cohere2": dict(SLIDING, layer_types=["sliding_attention", "full_attention"]),
    "starcoder2": SLIDING,
    "stablelm": MHA,
    "gpt_neox": MHA,
    "gpt2": dict(MHA, n_embd=64, n_layer=2, n_head=4, n_positions=256),
    "opt": dict(MHA, ffn_dim=128, word_embed_proj_dim=64),
    "phi": MHA,
    "smollm3": dict(no_rope_layers=[1, 0]),
    "glm": {},
    "glm4": {},
    "helium": {},
    "exaone4": dict(SLIDING, sliding_window_pattern=2),
    "ernie4_5": {},
    "seed_oss": {},
    "ministral": SLIDING,
    "internlm3": {},
    "nemotron": {},
    "hunyuan_v1_dense": {},
    "arcee": {},
    "apertus": {},
    # Sinks, biased experts with gpt-oss's routing and clamped SwiGLU, windows on alternate layers, YaRN
    # stretched from 32 positions so the long prompt's angles pass its interpolated range.
    "gpt_oss": dict(MOE, **SLIDING, layer_types=["sliding_attention", "full_attention"],
                    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=8.0, beta_fast=32.0,
                                         beta_slow=1.0, original_max_position_embeddings=32, truncate=False)),
}
# Weight seeds other than 0, where seed 0's reference has a near tie (the check in build() says so).
SEEDS = {"olmo3": 1}
LOGIT_SPREAD = 8.0  # std of the logits once the output embedding is scaled
MIN_MARGIN = 1e-3   # smallest top-1 / top-2 logit gap the reference may have at any greedy step


# The word tokenizer matches its special words t0 and t1 inside others ("t107" is "t1" + "07"):
# prompts use only the words that do not start with them.
WORDS = [i for i in range(PAD + 1, VOCAB) if not str(i).startswith(("0", "1"))]


def words(seed: int, n: int) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"t{WORDS[i]}" for i in torch.randint(0, len(WORDS), (n,), generator=g).tolist())


LONG = words(9, 5 * WINDOW + 5)  # 45 tokens: two full 16-token blocks come from the prefix cache
PROMPTS = [words(1, 5), words(2, 9), words(3, 13), LONG]


@dataclass
class Case:
    path: str
    window: int
    reference: dict[str, list[int]]   # prompt -> transformers' greedy continuation
    logits: torch.Tensor              # transformers' logits over LONG: [len, vocab]


_CASES: dict[str, Case] = {}


def build(arch: str, path: str) -> Case:
    """The tiny model of ``arch`` saved to ``path``, and transformers' greedy continuations of PROMPTS."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(SEEDS.get(arch, 0))
    cfg = AutoConfig.for_model(arch, **{**COMMON, **TINY[arch]})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    ids = [[int(w[1:]) for w in p.split()] for p in PROMPTS]
    with torch.inference_mode():
        # Scale the output embedding so the logits spread ~LOGIT_SPREAD: float32 differences between
        # the paged attention and transformers' (~1e-5 there) stay far below MIN_MARGIN, so any
        # divergence is a real one, never a near tie settled by rounding.
        spread = float(model(torch.tensor([ids[-1]])).logits.std())
        head = model.get_output_embeddings()
        head.weight.mul_(LOGIT_SPREAD / spread)
        if getattr(head, "bias", None) is not None:
            head.bias.mul_(LOGIT_SPREAD / spread)
        logits = model(torch.tensor([ids[-1]])).logits[0]
    model.save_pretrained(path)
    save_word_tokenizer(path)
    model.generation_config.eos_token_id = None  # the engine runs with ignore_eos: neither stops early
    reference, margins = {}, []
    with torch.inference_mode():
        for prompt, p_ids in zip(PROMPTS, ids):
            out = model.generate(torch.tensor([p_ids]), do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=PAD,
                                 output_scores=True, return_dict_in_generate=True)
            reference[prompt] = out.sequences[0, len(p_ids):].tolist()
            margins += [float(top[0] - top[1]) for top in (s[0].topk(2).values for s in out.scores)]
    assert min(margins) >= MIN_MARGIN, f"{arch}: a near tie in the reference ({min(margins):.1e}): change its seed"
    text = cfg.get_text_config()
    windows = [w for w in (getattr(text, "sliding_window", None), getattr(text, "attention_chunk_size", None)) if w]
    return Case(path=path, window=max(windows, default=0), reference=reference, logits=logits)


def case(arch: str, tmp_path_factory: pytest.TempPathFactory) -> Case:
    if arch not in _CASES:  # once per architecture, shared by both forwards of the fused ones
        _CASES[arch] = build(arch, str(tmp_path_factory.mktemp(arch)))
    return _CASES[arch]


def divergence(got: dict[str, list[int]], want: dict[str, list[int]]) -> str | None:
    for prompt, ref in want.items():
        ours = got.get(prompt)
        if ours != ref:
            at = next((i for i, (a, b) in enumerate(zip(ours or [], ref)) if a != b), len(ours or []))
            return f"the {len(prompt.split())}-token prompt diverges at token {at}: {ours} vs generate's {ref}"
    return None


RUNS = [(arch, True) for arch in sorted(VERIFIED)] + [(arch, False) for arch in FUSED]


@pytest.mark.parametrize("arch,fused", RUNS, ids=[f"{a}-{'fused' if f and a in FUSED else 'transformers'}"
                                                  for a, f in RUNS])
def test_greedy_equals_generate(arch: str, fused: bool, tmp_path_factory) -> None:
    c = case(arch, tmp_path_factory)
    assert len(LONG.split()) > c.window, "the long prompt must cross every sliding window"
    backend = TorchBackend(ServerConfig(model=c.path, dtype="float32", device="cpu", max_model_len=None),
                           TorchOptions.from_environ(fused_forward=fused))
    # transformers picks a tokenizer class by model type for some (Qwen2's, which splits these words
    # differently): the prompts go through the word tokenizer itself, as the reference's do.
    info = dataclasses.replace(backend.load(), tokenizer=PreTrainedTokenizerFast.from_pretrained(c.path))
    try:
        assert (backend._fused is not None) == (fused and arch in FUSED)
        assert backend.loaded.unverified is None
        alone, _ = run_engine((backend, info), PROMPTS, sequential=True, enable_prefix_caching=False)
        together, _ = run_engine((backend, info), PROMPTS)
        cached, engine = run_engine((backend, info), [LONG], passes=2)
        # The logits themselves (so the logprobs a request gets), after any scaling or softcapping the
        # architecture applies past its output embedding.
        long_ids = [int(w[1:]) for w in LONG.split()]
        logits = backend.forward_logits([StepItem(seq_id=0, token_ids=long_ids, start_pos=0, block_table=[0, 1, 2])])
    finally:
        backend.close()
    assert engine.block_manager.prefix_hit_tokens >= 32, "the second pass did not come from the prefix cache"
    failures = {name: why for name, got, want in (
        ("alone", alone, c.reference),
        ("four at once", together, c.reference),
        ("from the prefix cache", cached, {LONG: c.reference[LONG]}),
    ) if (why := divergence(got, want))}
    assert not failures, f"{arch} starts and answers differently from generate: {failures}"
    torch.testing.assert_close(logits[0], c.logits, atol=1e-3, rtol=1e-4, msg=lambda m: f"{arch}'s logits: {m}")


def test_the_lists_agree() -> None:
    """The test covers exactly the verified list; fused.py runs exactly FUSED; no family is both."""
    from llmserve.plugins.backends.torch import fused

    assert set(TINY) == set(VERIFIED)
    assert len(VERIFIED) >= 20
    assert set(FUSED) == fused._ARCHITECTURES | set(OWN_FORWARDS) and set(FUSED) <= set(VERIFIED)
    refused = set(STATEFUL) | set(architectures.UNSUPPORTED)
    assert not refused & set(VERIFIED) and not refused & set(architectures.HYBRID)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    unknown = (set(VERIFIED) | set(architectures.HYBRID) | refused) - set(CONFIG_MAPPING_NAMES)
    assert not unknown, f"model types this transformers does not know: {unknown}"


# ---- refused at start ---------------------------------------------------------------------------

TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
# model_type -> (its tiny config, words the refusal must say)
STATEFUL_MODELS = {
    "falcon_h1": (dict(TEXT, mamba_n_heads=4, mamba_d_head=32, mamba_d_ssm=128, mamba_d_state=16,
                       mamba_n_groups=1), "Mamba"),
}


@pytest.fixture(scope="module")
def serving_stateful(tmp_path_factory) -> Iterator[dict[str, subprocess.Popen]]:
    """``llmserve serve DIR`` on a tiny model of each stateful family, all started at once (each
    spends seconds importing; side by side they overlap)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    procs = {}
    for arch, (kwargs, _) in STATEFUL_MODELS.items():
        path = tmp_path_factory.mktemp(arch)
        torch.manual_seed(0)
        cfg = AutoConfig.for_model(arch, **kwargs)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
        cfg.save_pretrained(path)  # a multimodal family's checkpoints name the wrapper, as Qwen3.5's do
        save_word_tokenizer(str(path))
        assert json.loads((path / "config.json").read_text())["model_type"] == arch
        procs[arch] = subprocess.Popen([sys.executable, "-m", "llmserve", "serve", str(path), "--dtype", "float32",
                                        "--device", "cpu", "--port", "0"], cwd=ROOT, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    yield procs
    for proc in procs.values():
        if proc.poll() is None:  # one that started serving after all
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("arch", sorted(STATEFUL_MODELS))
def test_a_stateful_model_is_refused_at_start(arch: str, serving_stateful) -> None:
    proc = serving_stateful[arch]
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"llmserve serve kept running a {arch} model instead of refusing it") from None
    line = one_line_error(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    assert proc.returncode == 2
    assert f"'{arch}'" in line and STATEFUL_MODELS[arch][1] in line and "outside the KV cache" in line, line


def tiny_dir_with(tmp_path, **config: object) -> str:
    """A tiny Llama directory whose config.json then gets ``config`` written over it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **{**COMMON, "num_hidden_layers": 1})) \
        .save_pretrained(tmp_path)
    save_word_tokenizer(str(tmp_path))
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, **config}))
    return str(tmp_path)


def refusal(path: str, **flags: object) -> str:
    with pytest.raises(ConfigError) as err:
        load_model(ModelConfig(model=path, dtype="float32", device="cpu", **flags))
    assert "\n" not in str(err.value)
    return str(err.value)


def test_an_unknown_layer_kind_is_refused(tmp_path) -> None:
    path = tiny_dir_with(tmp_path, layer_types=["warp_attention"])
    line = refusal(path, allow_unverified_architecture=True)
    assert "'warp_attention'" in line and "does not know" in line and "'llama'" in line


def test_a_stateful_layer_kind_is_refused_whatever_the_model_type(tmp_path) -> None:
    path = tiny_dir_with(tmp_path, layer_types=["conv"])
    line = refusal(path, allow_unverified_architecture=True)
    assert "conv layers keep a convolution state outside the KV cache" in line


def test_a_model_type_transformers_does_not_know_is_refused(tmp_path) -> None:
    path = tiny_dir_with(tmp_path, model_type="frobnicator", architectures=["FrobnicatorForCausalLM"])
    line = refusal(path, allow_unverified_architecture=True)
    assert "'frobnicator'" in line and "does not know" in line


def test_an_unverified_architecture_needs_the_flag_and_is_named_in_the_plan(tmp_path, caplog, monkeypatch) -> None:
    path = tiny_dir_with(tmp_path, model_type="helium")  # a Llama-shaped config reads as a Helium one
    monkeypatch.delitem(architectures.VERIFIED, "helium")  # an architecture off the list
    line = refusal(path)
    assert "'helium'" in line and "has not verified" in line and architectures.FLAG in line
    backend = TorchBackend(ServerConfig(model=path, dtype="float32", device="cpu", max_model_len=None,
                                        allow_unverified_architecture=True))
    with caplog.at_level(logging.INFO, logger="llmserve.backend.torch"):
        backend.load()
        backend.init_kv_cache(KVCacheSpec(block_size=4, num_blocks=16))
    backend.close()
    plans = [r.getMessage() for r in caplog.records if r.getMessage().startswith("execution plan:")]
    assert len(plans) == 1 and plans[0].endswith(" WARNING=unverified-architecture:helium"), plans
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "unverified" in r.getMessage()]
    assert warned, "no warning when serving an unverified architecture"


def test_the_docs_table_is_the_list() -> None:
    text = (ROOT / "docs" / "engine.md").read_text()
    start, end = "<!-- architectures -->\n", "<!-- /architectures -->"
    assert start in text and end in text, "docs/engine.md lost its architecture table"
    table = text.split(start, 1)[1].split(end, 1)[0]
    assert table == architectures.markdown_table(), "regenerate it: python docs/tools/refresh_architectures.py"


def test_the_docs_refusal_sample_is_what_the_backend_says(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "falcon_h1"}))
    with pytest.raises(ConfigError) as err:
        architectures.check_config_file(str(tmp_path), "./tiny-falcon-h1")
    assert f"\nerror: {err.value}\n" in (ROOT / "docs" / "engine.md").read_text()
