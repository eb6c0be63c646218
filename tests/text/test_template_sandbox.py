"""The chat-template sandbox against the bombs request templates are known to carry: each
builtin that can build a huge value in one step is refused before it runs (fast, with little
memory), loops are stopped by the render deadline, reserved ``chat_template_kwargs`` are
refused by name, request templates need the trust switch, and a model template carrying a
template-injection payload is refused by ``vet_template``. Rendered with the real SmolLM2
tokenizer (its own chat template is the one vetted as safe)."""

from __future__ import annotations

import resource
import time

import pytest

from llmserve.errors import InvalidRequestError
from llmserve.text.chat_template import RESERVED_TEMPLATE_KWARGS, render_chat
from llmserve.text.sandbox import MAX_RENDER_CHARS, vet_template

MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from llmserve.plugins.backends.torch.loader import hf_directory

    return AutoTokenizer.from_pretrained(hf_directory(None))


def render(tokenizer, template: str | None = None, timeout: float = 2.0, **kwargs) -> str:
    return render_chat(tokenizer, MESSAGES, chat_template=template, trusted=True, timeout=timeout, **kwargs)


# Each builds (or would build) a string of 1e9 characters or more in one builtin call.
BOMBS = {
    "wordwrap": "{{ ('a b ' * 4000000) | wordwrap(1) }}",
    "replace filter": "{{ ('a' * 1000000) | replace('a', 'a' * 1000) }}",
    "replace method": "{{ ('a' * 1000000).replace('a', 'a' * 1000) }}",
    "%-format width": "{{ '%999999999d' % 1 }}",
    "%-format star width": "{{ '%*d' % (999999999, 1) }}",
    "%-format repeated fields": "{{ ('%s' * 1000) % ((('x' * 1000000),) * 1000) }}",
    "str.format width": "{{ '{:>999999999}'.format(1) }}",
    "str.format repeated argument": "{{ ('{0}' * 10000).format('x' * 100000) }}",
    "format filter": "{{ '%999999999d' | format(1) }}",
    "center filter": "{{ 'x' | center(1000000000) }}",
    "ljust": "{{ 'x'.ljust(1000000000) }}",
    "indent": "{{ ('a\n' * 4000000) | indent(1000) }}",
    "join separator": "{{ ('x' * 1000000).join(['a'] * 100000) }}",
    "doubling with ~": "{% set ns = namespace(s='x' * 10000000) %}{% for i in range(40) %}"
                       "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
    "doubling with +": "{% set ns = namespace(s='x' * 10000000) %}{% for i in range(40) %}"
                       "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s | length }}",
    "squaring an integer": "{% set ns = namespace(x=10) %}{% for i in range(40) %}"
                           "{% set ns.x = ns.x * ns.x %}{% endfor %}{{ 1 }}",
}


@pytest.mark.parametrize("name", list(BOMBS))
def test_value_bombs_are_refused_before_they_run(tokenizer, name):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    with pytest.raises(InvalidRequestError) as info:
        render(tokenizer, BOMBS[name], timeout=30.0)
    elapsed = time.monotonic() - start
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert info.value.param == "chat_template"
    assert "too large" in info.value.message or str(MAX_RENDER_CHARS) in info.value.message, info.value.message
    assert elapsed < 10.0  # refused up front, not after a 30 s render
    assert grown_mb < 400, f"{name}: peak RSS grew by {grown_mb:.0f} MB"


def test_loops_stop_at_the_render_deadline(tokenizer):
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}done"
    start = time.monotonic()
    with pytest.raises(InvalidRequestError) as info:
        render(tokenizer, loops, timeout=1.0)
    assert "longer than 1 s" in info.value.message and info.value.param == "chat_template"
    assert time.monotonic() - start < 5.0
    # A Python-level filter looping on a big input is stopped by the same deadline.
    with pytest.raises(InvalidRequestError, match="longer than 1 s"):
        render(tokenizer, "{{ ('a b ' * 1000000) | wordwrap(3) }}", timeout=1.0)


def test_ordinary_templates_still_render(tokenizer):
    assert render(tokenizer) == tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    small = "{{ '%5d|%s' % (42, 'x') }}{{ 'a-b' | replace('-', '+') }}{{ 'ab' | center(6) }}{{ 'x' ~ 'y' }}" \
            "{{ ', '.join(['p', 'q']) }}{{ '{0}{0}'.format('z') }}{{ (['m'] * 3) | join }}"
    assert render(tokenizer, small) == "   42|xa+b  ab  xyp, qzzmmm"


def test_request_templates_need_the_trust_switch(tokenizer):
    with pytest.raises(InvalidRequestError) as info:
        render_chat(tokenizer, MESSAGES, chat_template="{{ messages[0]['content'] }}")
    assert info.value.param == "chat_template" and "--trust-request-chat-template" in info.value.message
    assert render_chat(tokenizer, MESSAGES, chat_template="{{ messages[0]['content'] }}", trusted=True) == \
        "Hello there"


@pytest.mark.parametrize("key", ["tokenize", "chat_template", "return_dict", "messages", "add_generation_prompt",
                                 "bos_token", "__class__", "not an identifier"])
def test_reserved_template_kwargs_are_refused_by_name(tokenizer, key):
    with pytest.raises(InvalidRequestError) as info:
        render_chat(tokenizer, MESSAGES, template_kwargs={key: True})
    assert info.value.param == "chat_template_kwargs" and repr(key) in info.value.message


def test_template_kwargs_reach_only_the_variables_a_template_reads(tokenizer):
    assert {"tokenize", "chat_template", "return_dict"} <= RESERVED_TEMPLATE_KWARGS
    template = "{{ greeting | default('none') }}/{{ enable_thinking | default('unset') }}"
    out = render_chat(tokenizer, MESSAGES, chat_template=template, trusted=True,
                      template_kwargs={"greeting": "hi", "unrelated": "x" * 100})
    assert out == "hi/unset"
    # A key the model's own template does not read is dropped, not an error (clients send
    # enable_thinking to every model).
    assert render_chat(tokenizer, MESSAGES, template_kwargs={"enable_thinking": False}) == render(tokenizer)


PAYLOADS = [
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{% for m in messages %}{{ m.content }}{% endfor %}{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ self._TemplateReference__context }}",
    "{{ ()|attr('__class__') }}",
    "{% if messages %}{{ messages['__class__'] }}{% endif %}",
]


@pytest.mark.parametrize("payload", PAYLOADS)
def test_injection_payloads_are_vetted_out(tokenizer, payload):
    why = vet_template(payload)
    assert why is not None and "no chat template needs" in why
    # And were one served anyway, the sandbox would still stop it at render time: an error, or
    # an undefined value that renders as nothing.
    try:
        out = render(tokenizer, payload)
    except InvalidRequestError as exc:
        assert exc.param == "chat_template"
    else:
        assert "Hello there" in out or out.strip() == "", out
        assert "Context" not in out and "class" not in out and "uid=" not in out


def test_real_templates_pass_the_vetting(tokenizer):
    assert vet_template(tokenizer.chat_template) is None
    assert vet_template("{% set ns = namespace(found=false) %}{% for m in messages %}{{ m['role'] }}: "
                        "{{ m.content | trim }}{% endfor %}{{ raise_exception('x') if false }}") is None
