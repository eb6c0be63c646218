"""The hostile values of the probe runs, against the real embedded SmolLM2 in every dialect they
apply to: each is a 4xx in the dialect's format, answered before any costly work, and the
server keeps serving. Request chat templates: the trust switch holds on every route, reserved
``chat_template_kwargs`` are refused by name, a 10^5 x 10^5 loop is stopped by the render cap
while other requests go on, and a model whose own template is an injection payload does not
start."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from conftest import ROOT

from .conftest import InProcServer

pytestmark = pytest.mark.slow

SURROGATE = "\ud800"
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def post(server: InProcServer, path: str, body: Any = None, raw: str | None = None) -> httpx.Response:
    text = raw if raw is not None else json.dumps(body)  # json.dumps escapes surrogates as \ud800
    return httpx.post(server.url + path, content=text.encode(), headers={"Content-Type": "application/json"},
                      timeout=120)


def assert_refused(r: httpx.Response, *needles: str) -> None:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    body = r.json()
    assert isinstance(body, dict) and "error" in body, body  # every built-in format has an `error` key
    for needle in needles:
        assert needle in r.text, (needle, r.text[:300])


def still_serving(server: InProcServer) -> None:
    r = post(server, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
    server.check_idle()


def surrogate_cases(model: str) -> dict[str, tuple[str, dict]]:
    s = f"Hello {SURROGATE} world"
    return {
        "completions prompt": ("/v1/completions", {"prompt": s, "max_tokens": 2}),
        "completions prompt list": ("/v1/completions", {"prompt": ["ok", s], "max_tokens": 2}),
        "completions request_id": ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "request_id": s}),
        "completions stop": ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": [s]}),
        "chat message": ("/v1/chat/completions", {"messages": [{"role": "user", "content": s}], "max_tokens": 2}),
        "chat role": ("/v1/chat/completions", {"messages": [{"role": s, "content": "hi"}], "max_tokens": 2}),
        "tokenize prompt": ("/tokenize", {"prompt": s}),
        "tokenize messages": ("/tokenize", {"messages": [{"role": "user", "content": s}]}),
        "tgi inputs": ("/generate", {"inputs": s, "parameters": {"max_new_tokens": 2}}),
        "tgi stop": ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2, "stop": [s]}}),
        "vllm prompt": ("/generate", {"prompt": s, "max_tokens": 2}),
        "mindie inputs": ("/infer", {"inputs": s, "parameters": {"max_new_tokens": 2}}),
        "triton generate": (f"/v2/models/{model}/generate", {"text_input": s, "parameters": {"max_new_tokens": 2}}),
        "triton generate id": (f"/v2/models/{model}/generate", {"text_input": "hi", "id": s}),
        "triton infer tensor": (f"/v2/models/{model}/infer",
                                {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [s]}]}),
    }


def test_lone_surrogates_are_a_4xx_in_every_dialect(smollm_inproc):
    server = smollm_inproc
    for name, (path, body) in surrogate_cases(server.context.model_name).items():
        r = post(server, path, body)
        assert_refused(r, "surrogate")
        assert r.status_code != 424, name
    still_serving(server)


NUMBER_CASES: list[tuple[str, str, str]] = [
    # (path, raw JSON body, field the error names)
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "repetition_penalty": 1e999}', "repetition_penalty"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "repetition_penalty": Infinity}', "repetition_penalty"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "repetition_penalty": 1e300}', "repetition_penalty"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "temperature": 1e-300}', "temperature"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "temperature": NaN}', "temperature"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": -5}', "max_tokens"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "seed": -1}', "seed"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "priority": 1000000000000000000000000000000}', "priority"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": true, '
                             '"top_logprobs": -1}', "top_logprobs"),
    ("/generate", '{"inputs": "hi", "parameters": {"max_new_tokens": 2, "temperature": 1e999}}', "temperature"),
    ("/generate", '{"inputs": "hi", "parameters": {"max_new_tokens": 2, "temperature": Infinity}}', "temperature"),
    ("/generate", '{"inputs": "hi", "parameters": {"max_new_tokens": 2, "do_sample": true, "temperature": 1e-300}}',
     "temperature"),
    ("/generate", '{"inputs": "hi", "parameters": {"max_new_tokens": 2, "repetition_penalty": 1e999}}',
     "repetition_penalty"),
    ("/generate", '{"inputs": "hi", "parameters": {"max_new_tokens": 2, "truncate": -1}}', "truncate"),
    ("/generate", '{"prompt": "hi", "max_tokens": 2, "repetition_penalty": 1e999}', "repetition_penalty"),
    ("/generate", '{"prompt": "hi", "max_tokens": 2, "top_k": -7}', "top_k"),
    ("/infer", '{"inputs": "hi", "parameters": {"max_new_tokens": 2, "repetition_penalty": Infinity}}',
     "repetition_penalty"),
    ("/infer", '{"inputs": "hi", "parameters": {"max_new_tokens": 2, "timeout": -1}}', "timeout"),
    ("/v2/models/{m}/generate", '{"text_input": "hi", "parameters": {"batch_size": 1000000000000000000000000000000}}',
     "batch_size"),
    ("/v2/models/{m}/generate", '{"text_input": "hi", "batch_size": 1000000000000000000000000000000}', "batch_size"),
    ("/v2/models/{m}/generate", '{"text_input": "hi", "parameters": {"temperature": 1e999}}', "temperature"),
    ("/v2/models/{m}/infer", '{"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["hi"]}],'
                             ' "parameters": {"priority": -1}}', "priority"),
]


@pytest.mark.parametrize("path, raw, field", NUMBER_CASES)
def test_non_finite_absurd_and_negative_numbers_are_a_4xx(smollm_inproc, path, raw, field):
    r = post(smollm_inproc, path.replace("{m}", smollm_inproc.context.model_name), raw=raw)
    assert_refused(r, field)


def test_strict_types_as_the_openai_client_meets_them(smollm_inproc):
    client = openai.OpenAI(base_url=smollm_inproc.url + "/v1", api_key="none", max_retries=0)
    model = smollm_inproc.context.model_name
    for extra, param in (({"max_tokens": "10"}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
                         ({"logprobs": "yes"}, "logprobs"), ({"stream": "yes"}, "stream"),
                         ({"temperature": "0.5"}, "temperature"), ({"echo": 1}, "echo")):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=model, prompt="hi", extra_body=extra)
        assert err.value.body["param"] == param, err.value.body
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"max_completion_tokens": "3"})
    assert err.value.body["param"] == "max_completion_tokens"
    # Numbers as numbers, booleans as booleans: unchanged.
    out = client.completions.create(model=model, prompt="hi", max_tokens=2, temperature=0, logprobs=1, echo=False)
    assert out.usage.completion_tokens == 2


def bounded_cases(model: str) -> list[tuple[str, dict]]:
    big_bias = {str(i): 1 for i in range(5000)}
    return [
        ("/v1/completions", {"prompt": "hi", "n": 10**6}),
        ("/v1/completions", {"prompt": "hi", "best_of": 10**6}),
        ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 10**6}),
        ("/v1/completions", {"prompt": "hi", "logprobs": 10**6}),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 10**6}),
        ("/v1/completions", {"prompt": "hi", "logit_bias": big_bias}),
        ("/v1/completions", {"prompt": "hi", "bad_words": ["x"] * 5000}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 10**6}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                  "top_logprobs": 10**6}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logit_bias": big_bias}),
        ("/generate", {"prompt": "hi", "n": 10**6}),
        ("/generate", {"prompt": "hi", "best_of": 10**6}),
        ("/generate", {"inputs": "hi", "parameters": {"best_of": 10**6, "do_sample": True}}),
        ("/generate", {"inputs": "hi", "parameters": {"top_n_tokens": 10**6}}),
        (f"/v2/models/{model}/generate", {"text_input": "hi", "parameters": {"max_new_tokens": 10**12}}),
    ]


def test_bounded_work_is_refused_within_50_ms(smollm_inproc):
    server = smollm_inproc
    with httpx.Client(base_url=server.url, timeout=60) as client:
        client.get("/health")  # a warm connection: the time measured is the server's answer
        for path, body in bounded_cases(server.context.model_name):
            text = json.dumps(body).encode()
            times = []
            for _ in range(5):  # the best of five: the server answers fast when not descheduled
                start = time.perf_counter()
                r = client.post(path, content=text, headers={"Content-Type": "application/json"})
                times.append(time.perf_counter() - start)
                assert_refused(r)
            assert min(times) < 0.05, (path, body if len(text) < 200 else text[:200], min(times))
    still_serving(server)


EMPTY_PROMPTS: list[tuple[str, dict]] = [
    ("/v1/completions", {"prompt": ""}), ("/v1/completions", {"prompt": []}),
    ("/v1/completions", {"prompt": [[]]}), ("/v1/completions", {"prompt": [""]}),
    ("/v1/completions", {"prompt": ["ok", ""]}),
    ("/v1/chat/completions", {"messages": []}),
    ("/generate", {"prompt": ""}), ("/generate", {"prompt": []}),
    ("/generate", {"inputs": ""}), ("/generate", {"inputs": []}),
    ("/infer", {"inputs": ""}), ("/infer", {"inputs": []}),
    ("/v2/models/{m}/generate", {"text_input": ""}), ("/v2/models/{m}/generate", {"text_input": []}),
    ("/v2/models/{m}/infer", {"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [""]}]}),
    ("/v2/models/{m}/infer", {"inputs": [{"name": "input0", "shape": [0], "datatype": "UINT32", "data": []}]}),
]


@pytest.mark.parametrize("path, body", EMPTY_PROMPTS)
def test_empty_prompts_in_every_shape_are_a_4xx(smollm_inproc, path, body):
    r = post(smollm_inproc, path.replace("{m}", smollm_inproc.context.model_name), body)
    assert_refused(r)


# -- chat templates -------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["tokenize", "chat_template", "return_dict"])
def test_reserved_chat_template_kwargs_are_refused_by_name(smollm_inproc, key):
    client = openai.OpenAI(base_url=smollm_inproc.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=smollm_inproc.context.model_name, max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"chat_template_kwargs": {key: True}})
    assert err.value.body["param"] == "chat_template_kwargs" and repr(key) in err.value.body["message"]
    r = post(smollm_inproc, "/tokenize", {"messages": [{"role": "user", "content": "hi"}],
                                          "chat_template_kwargs": {key: True}})
    assert_refused(r, key)
    # A harmless key the template does not read changes nothing.
    plain = post(smollm_inproc, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
    other = post(smollm_inproc, "/tokenize", {"messages": [{"role": "user", "content": "hi"}],
                                              "chat_template_kwargs": {"enable_thinking": False}}).json()["tokens"]
    assert plain == other


def test_tokenize_honours_the_trust_switch(smollm_inproc):
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": "INJECTED {{ messages[0]['content'] }}"}
    r = post(smollm_inproc, "/tokenize", body)
    assert_refused(r, "chat_template", "--trust-request-chat-template")


@pytest.fixture(scope="module")
def trusted():
    server = InProcServer(dtype="float32", device="cpu", max_model_len=512, max_num_seqs=8,
                          trust_request_chat_template=True, chat_template_render_timeout=6.0)
    yield server
    server.stop()


def test_tokenize_renders_a_trusted_request_template(trusted):
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": "INJECTED {{ messages[0]['content'] }}",
            "add_special_tokens": False}
    r = post(trusted, "/tokenize", body)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == trusted.context.engine.tokenizer.encode("INJECTED hi", add_special_tokens=False)


def test_loop_bomb_stops_at_the_render_cap_and_others_keep_going(trusted):
    """A trusted template that loops is stopped at the render cap (6 s here), and ordinary
    requests are answered while it renders: the render shares the interpreter lock
    (``quick_handoff``), so the engine thread is not starved of it (before, one 2-token
    completion took 4-7 s beside the render on 2 cores; now about 1 s)."""
    bomb = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    results: dict[str, Any] = {}

    def send_bomb() -> None:
        results["bomb"] = post(trusted, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "chat_template": bomb, "max_tokens": 2})
        results["bomb_done"] = time.monotonic()

    started = time.monotonic()
    thread = threading.Thread(target=send_bomb)
    thread.start()
    time.sleep(0.3)  # the bomb is rendering
    answered = []
    while thread.is_alive() and len(answered) < 10:
        r = post(trusted, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 2,
                                              "temperature": 0})
        assert r.status_code == 200, r.text
        answered.append(time.monotonic())
    thread.join(60)
    assert_refused(results["bomb"], "longer than 6 s", "chat_template")
    assert results["bomb_done"] - started < 40  # the 6 s cap, with room for a loaded machine
    during = [t for t in answered if t < results["bomb_done"]]
    assert len(during) >= 2, (answered, results["bomb_done"])  # others are served while it renders
    trusted.check_idle()


def test_a_model_whose_template_is_an_injection_payload_does_not_start(tmp_path: Path):
    from llmserve.plugins.backends.torch.loader import hf_directory

    source = Path(hf_directory(None))
    model = tmp_path / "evil-model"
    model.mkdir()
    for item in source.iterdir():
        if item.name == "tokenizer_config.json":
            config = json.loads(item.read_text())
            config["chat_template"] = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                                       "{{ cycler.__init__.__globals__.os.popen('id').read() }}")
            (model / item.name).write_text(json.dumps(config))
        elif item.name != "chat_template.jinja":
            os.symlink(item, model / item.name)
    if (source / "chat_template.jinja").exists():
        shutil.copy(source / "chat_template.jinja", model / "chat_template.jinja")
        text = (model / "chat_template.jinja").read_text() + "{{ cycler.__init__.__globals__.os.popen('id').read() }}"
        (model / "chat_template.jinja").write_text(text)
    proc = subprocess.run([sys.executable, "-m", "llmserve", "serve", str(model), "--device", "cpu",
                           "--dtype", "float32", "--port", "0"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-2000:]  # a configuration error
    assert "chat template" in out and "refused" in out and "`__globals__`" in out, out[-2000:]
    assert "Traceback" not in out, out[-2000:]
