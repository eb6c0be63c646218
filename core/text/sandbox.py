"""The jinja2 sandbox chat templates run in: no attribute escapes (jinja2's immutable sandbox),
and no CPU or memory bombs (this module).

jinja2's sandbox stops ``{{ x.__class__ }}`` but not a template that builds a gigabyte string
in one builtin call (``'x'|center(10**9)``, ``s|replace('a', s)``, ``'%999999999d' % 1``) or
doubles a value in a loop (``{% set ns.s = ns.s ~ ns.s %}``). Every operation that can make a
value much larger than its inputs is checked *before* it runs, against ``MAX_RENDER_CHARS``;
loops and Python-level filters are stopped by the render deadline (``chat_template``).
``vet_template`` refuses, at model load, a template that reaches for the attributes a
template-injection payload needs.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Largest value (string, list) a template may build, and largest prompt text it may produce;
# far above any context window, far below a memory problem.
MAX_RENDER_CHARS = 16 * 1024 * 1024
MAX_INT_BITS = 1 << 16  # integers past 65536 bits (~20k digits) only serve to burn CPU
# Globals no chat template uses and template-injection payloads like (``lipsum.__globals__``).
PAYLOAD_GLOBALS = frozenset({"lipsum", "cycler", "joiner"})
_NUMBER = re.compile(r"\d+")


class TemplateTooCostly(Exception):
    """Rendering ran past its time cap, or an operation would build a value past the size cap."""


def _too_big(what: str) -> TemplateTooCostly:
    return TemplateTooCostly(f"the chat template builds {what} of more than {MAX_RENDER_CHARS} characters")


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple)) else len(str(value))


def _check(size: int, what: str = "a string") -> None:
    if size > MAX_RENDER_CHARS:
        raise _too_big(what)


# -- operators ------------------------------------------------------------------------------
def _multiply(left: Any, right: Any) -> Any:
    for seq, count in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
            _check(len(seq) * max(count, 0), "a value")
    if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
        raise TemplateTooCostly("the chat template computes a number that is too large")
    return left * right


def _power(left: Any, right: Any) -> Any:
    if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and (
            right > 4096 or left.bit_length() * right > MAX_INT_BITS):
        raise TemplateTooCostly("the chat template computes a number that is too large")
    return left ** right


def _add(left: Any, right: Any) -> Any:
    if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
        _check(len(left) + len(right), "a value")
    return left + right


def _check_format(fmt: str, args: Iterable[Any]) -> None:
    """``%`` / ``str.format`` / ``|format``: no field width past the cap (``%999999999d``,
    ``{:>999999999}``, ``%*d`` with a huge argument) and no output past it (each field filled
    with the largest argument: fields may repeat one argument)."""
    values = list(args)
    if any(int(d) > MAX_RENDER_CHARS for d in _NUMBER.findall(fmt) if len(d) <= 12) or any(
            len(d) > 12 for d in _NUMBER.findall(fmt)):
        raise _too_big("a formatted string")
    if any(isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_RENDER_CHARS for v in values) and (
            "*" in fmt or re.search(r"\{[^{}]*\{", fmt)):
        raise _too_big("a formatted string")
    fields = fmt.count("%") + fmt.count("{")
    _check(len(fmt) + fields * max((_size(v) for v in values), default=0), "a formatted string")


def _format_args(right: Any) -> list[Any]:
    if isinstance(right, tuple):
        return list(right)
    if isinstance(right, dict):
        return list(right.values())
    return [right]


def _modulo(left: Any, right: Any) -> Any:
    if isinstance(left, str):
        _check_format(left, _format_args(right))
    return left % right


_BINOPS = {"*": _multiply, "**": _power, "+": _add, "%": _modulo}


def _concat(values: Iterable[Any]) -> str:
    """``a ~ b``: the pieces are joined only if the result stays under the cap."""
    parts = [str(v) for v in values]
    _check(sum(map(len, parts)))
    return "".join(parts)


# -- str methods and filters ------------------------------------------------------------------
def _estimate_replace(s: str, old: Any, new: Any, count: Any = -1) -> None:
    old, new = str(old), str(new)
    hits = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    _check(len(s) + hits * (len(new) - len(old)))


def _check_str_method(s: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a call to a method of ``s`` whose result would pass the size cap."""
    if name == "replace" and len(args) >= 2:
        _estimate_replace(s, *args[:3])
    elif name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
        _check(args[0])
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        _check(len(s) + s.count("\t") * size if isinstance(size, int) else len(s))
    elif name in ("format", "format_map"):
        _check_format(s, [*args, *kwargs.values()] if name == "format" else _format_args(args[0] if args else {}))
    elif name == "translate" and args and isinstance(args[0], dict):
        widest = max((_size(v) for v in args[0].values() if v is not None), default=1)
        _check(len(s) * max(widest, 1))


def _join_size(sep: str, items: list[Any]) -> None:
    _check(sum(_size(i) for i in items) + len(sep) * max(len(items) - 1, 0))


def _capped_filters(env: ImmutableSandboxedEnvironment) -> None:
    """Wrap the built-in filters that can build a value much larger than their input."""
    filters = env.filters
    replace, center, indent, wordwrap, fmt = (filters[n] for n in ("replace", "center", "indent", "wordwrap",
                                                                     "format"))

    def do_replace(eval_ctx: Any, s: Any, old: Any, new: Any, count: Any = None) -> Any:
        _estimate_replace(str(s), old, new, -1 if count is None else count)
        return replace(eval_ctx, s, old, new, count)

    def do_center(value: Any, width: int = 80) -> Any:
        _check(max(len(str(value)), width if isinstance(width, int) else 0))
        return center(value, width)

    def do_indent(s: Any, width: Any = 4, first: bool = False, blank: bool = False) -> Any:
        text = str(s)
        _check(len(text) + (text.count("\n") + 1) * (_size(width) if isinstance(width, str) else int(width)))
        return indent(s, width, first, blank)

    def do_wordwrap(environment: Any, s: Any, width: int = 79, break_long_words: bool = True,
                    wrapstring: str | None = None, break_on_hyphens: bool = True) -> Any:
        text, joint = str(s), wrapstring or "\n"
        _check(len(text) + (len(text) // max(int(width), 1) + 1) * len(joint))
        return wordwrap(environment, s, width, break_long_words, wrapstring, break_on_hyphens)

    def do_format(value: Any, *args: Any, **kwargs: Any) -> Any:
        _check_format(str(value), [*args, *kwargs.values()])
        return fmt(value, *args, **kwargs)

    do_replace.jinja_pass_arg = replace.jinja_pass_arg  # type: ignore[attr-defined]
    do_wordwrap.jinja_pass_arg = wordwrap.jinja_pass_arg  # type: ignore[attr-defined]
    filters.update(replace=do_replace, center=do_center, indent=do_indent, wordwrap=do_wordwrap, format=do_format)


class _CappedCodeGenerator(CodeGenerator):
    """Compiles ``a ~ b`` to the environment's capped join instead of jinja2's plain one."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.capped_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class CappedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, with every value-growing operation checked first."""

    code_generator_class = _CappedCodeGenerator
    intercepted_binops = frozenset(_BINOPS)

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        for name in PAYLOAD_GLOBALS:
            self.globals.pop(name, None)
        _capped_filters(self)

    @staticmethod
    def capped_concat(values: Iterable[Any]) -> str:
        return _concat(values)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        return _BINOPS[operator](left, right)

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        target = getattr(obj, "__wrapped__", obj)  # str.format arrives wrapped by the sandbox
        owner, name = getattr(target, "__self__", None), getattr(target, "__name__", "")
        if isinstance(owner, str):
            if name == "join" and args:
                items = list(args[0])
                _join_size(owner, items)
                args = (items, *args[1:])
            else:
                _check_str_method(owner, name, args, kwargs)
        return super().call(context, obj, *args, **kwargs)


# -- vetting a model's own template ---------------------------------------------------------
def _forbidden(node: nodes.Node) -> str | None:
    """What in ``node`` only a template-injection payload would use, or None."""
    if isinstance(node, nodes.Getattr) and node.attr.startswith("_"):
        return f"the attribute `{node.attr}`"
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and isinstance(
            node.arg.value, str) and node.arg.value.startswith("_"):
        return f"the item `{node.arg.value}`"
    if isinstance(node, nodes.Filter) and node.name == "attr":
        return "the `attr` filter"
    if isinstance(node, nodes.Name) and node.name in PAYLOAD_GLOBALS:
        return f"the global `{node.name}`"
    return None


def vet_template(source: str) -> str | None:
    """Why ``source`` (a model's own chat template) must not be served, or None when it may.

    A template that reads private or dunder attributes (``__class__``, ``__globals__``), uses
    the ``attr`` filter or the ``lipsum`` / ``cycler`` / ``joiner`` globals is a
    template-injection payload, not a chat format: the sandbox would stop it at render time,
    but a server that loads it is compromised by intent, so it is refused up front. A
    template that does not parse is left to fail per request, as before."""
    from jinja2 import TemplateSyntaxError

    try:
        tree = CappedSandbox().parse(source)
    except TemplateSyntaxError:
        return None
    for node in tree.find_all(nodes.Node):
        found = _forbidden(node)
        if found is not None:
            return f"it uses {found} (line {node.lineno}), which no chat template needs"
    return None


def refuse_injected_templates(model: str, templates: Iterable[Any]) -> None:
    """Refuse to serve ``model`` (a ``ConfigError``) when one of its chat templates (strings, or
    dicts of named ones, as tokenizers keep them) fails ``vet_template``. Backends call it as
    soon as the tokenizer is read, before any weight is; ``ModelInfo`` calls it again."""
    from llmserve.errors import ConfigError

    for template in templates:
        for source in (template.values() if isinstance(template, dict) else [template]):
            why = vet_template(source) if isinstance(source, str) else None
            if why is not None:
                raise ConfigError(f"the chat template of model '{model}' was refused: {why} (a jinja "
                                  f"template-injection payload); fix its chat template (tokenizer_config.json "
                                  f"or chat_template.jinja)")
