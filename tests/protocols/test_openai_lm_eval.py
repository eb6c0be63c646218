"""EleutherAI's lm-evaluation-harness (``lm_eval``) with its ``local-completions`` model against the
real embedded SmolLM2: a multiple-choice (loglikelihood) task and a generate_until task, both
defined here with tiny local JSONL data (no downloads).

lm_eval lives in its own venv (``.venv-lmeval``, made by ``make test``): it drags in datasets,
pandas and scikit-learn, none of which this venv needs. It tokenizes through the server's own
``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` routes (``tokenizer_backend=remote``).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

MC_DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "Berlin", "Madrid"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["seven", "four", "ten"], "answer": 1},
    {"question": "The opposite of hot is", "choices": ["blue", "loud", "cold"], "answer": 2},
    {"question": "A dog says", "choices": ["woof", "moo", "quack"], "answer": 0},
]
GEN_DOCS = [
    {"question": "What is the capital of France?", "answer": "Paris"},
    {"question": "What colour is the sky on a clear day?", "answer": "Blue"},
    {"question": "How many legs does a cat have?", "answer": "Four"},
]
UNTIL = ["\n", "."]

MC_TASK = """\
task: llmserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

GEN_TASK = """\
task: llmserve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: answer
generation_kwargs:
  until: {until}
  max_gen_toks: 12
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
"""


def lm_eval_binary() -> str | None:
    for candidate in (os.environ.get("LM_EVAL"), str(ROOT / ".venv-lmeval" / "bin" / "lm_eval")):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def write_jsonl(path: Path, docs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


@pytest.fixture(scope="module")
def lm_eval_run(smollm_server, tmp_path_factory):
    """Run both tasks once; yield (results json, samples by task name, server url, model name)."""
    binary = lm_eval_binary()
    if binary is None:
        message = ("lm_eval is not installed: `make test` puts it in .venv-lmeval "
                   "(python -m venv .venv-lmeval && .venv-lmeval/bin/pip install 'lm_eval[api]'), or set LM_EVAL")
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    url = smollm_server.url
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    tmp = tmp_path_factory.mktemp("lm-eval")
    tasks = tmp / "tasks"
    tasks.mkdir()
    mc_data = write_jsonl(tmp / "mc.jsonl", MC_DOCS)
    gen_data = write_jsonl(tmp / "gen.jsonl", GEN_DOCS)
    (tasks / "llmserve_mc.yaml").write_text(MC_TASK.format(data=mc_data))
    (tasks / "llmserve_gen.yaml").write_text(GEN_TASK.format(data=gen_data, until=json.dumps(UNTIL)))
    env = {**os.environ, "HF_HOME": str(tmp / "hf"), "HF_DATASETS_CACHE": str(tmp / "hf" / "datasets"),
           "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    model_args = ",".join([f"model={model}", f"base_url={url}/v1/completions", "tokenizer_backend=remote",
                           "num_concurrent=2", "max_retries=1", "max_length=2048", "timeout=120"])
    out = tmp / "out"
    proc = subprocess.run(
        [binary, "--model", "local-completions", "--model_args", model_args,
         "--tasks", "llmserve_mc,llmserve_gen", "--include_path", str(tasks), "--batch_size", "1",
         "--output_path", str(out), "--log_samples"],
        capture_output=True, text=True, env=env, timeout=280, cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    results_files = sorted(out.rglob("results_*.json"))
    assert results_files, list(out.rglob("*"))
    results = json.loads(results_files[-1].read_text())
    samples = {}
    for task in ("llmserve_mc", "llmserve_gen"):
        files = sorted(out.rglob(f"samples_{task}_*.jsonl"))
        assert files, list(out.rglob("*"))
        samples[task] = sorted((json.loads(line) for line in files[-1].read_text().splitlines() if line),
                               key=lambda s: s["doc_id"])
    return results, samples, url, model


def server_loglikelihood(url: str, model: str, context: str, continuation: str) -> float:
    """The continuation's log-probability as the server computes it: echo the whole text and add up
    the logprobs of the tokens that start at or after the context's end (by text offset)."""
    r = httpx.post(url + "/v1/completions", json={
        "model": model, "prompt": context + continuation, "echo": True, "logprobs": 0, "max_tokens": 1,
        "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    pairs = list(zip(lp["text_offset"], lp["token_logprobs"]))[:prompt_tokens]
    return sum(value for offset, value in pairs if offset >= len(context))


def test_multiple_choice_accuracy_and_loglikelihoods(lm_eval_run):
    results, samples, url, model = lm_eval_run
    acc = results["results"]["llmserve_mc"]["acc,none"]
    assert isinstance(acc, float) and 0.0 <= acc <= 1.0
    docs = samples["llmserve_mc"]
    assert [s["doc_id"] for s in docs] == list(range(len(MC_DOCS)))
    correct = 0
    for sample, doc in zip(docs, MC_DOCS):
        # One (loglikelihood, is_greedy) pair per choice; the samples file writes them as strings.
        received = [(float(value), greedy == "True") for value, greedy in sample["filtered_resps"]]
        assert len(received) == len(doc["choices"])
        for (value, _greedy), choice in zip(received, doc["choices"]):
            expected = server_loglikelihood(url, model, doc["question"], " " + choice)
            assert value == pytest.approx(expected, abs=2e-3), (doc, choice)
        for (_, greedy), choice in zip(received, doc["choices"]):
            if greedy:  # every continuation token was the argmax: greedy decoding writes it out
                r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": doc["question"],
                                                              "max_tokens": 4, "temperature": 0}, timeout=60)
                assert r.json()["choices"][0]["text"].startswith(" " + choice)
        correct += max(range(len(received)), key=lambda i: received[i][0]) == doc["answer"]
    # The harness's accuracy is the share of documents whose gold choice scored highest.
    assert acc == pytest.approx(correct / len(MC_DOCS))
    assert docs[0]["filtered_resps"][0][1] == "True"  # " Paris" is SmolLM2's greedy continuation


def test_generate_until_stops_at_until(lm_eval_run):
    results, samples, url, model = lm_eval_run
    em = results["results"]["llmserve_gen"]["exact_match,none"]
    assert isinstance(em, float) and 0.0 <= em <= 1.0
    docs = samples["llmserve_gen"]
    assert len(docs) == len(GEN_DOCS)
    for sample, doc in zip(docs, GEN_DOCS):
        text = sample["resps"][0][0]
        assert not any(stop in text for stop in UNTIL), text
        # Greedy: the harness got exactly what the server answers for the same prompt and stops.
        prompt = f"Q: {doc['question']}\nA:"
        r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 12,
                                                      "temperature": 0, "stop": UNTIL}, timeout=60).json()
        assert text == r["choices"][0]["text"]
    assert "Paris" in docs[0]["resps"][0][0]
