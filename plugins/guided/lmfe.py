"""The ``lm-format-enforcer`` guided decoder.

One ``LMFormatEnforcerDecoder`` per server holds the tokenizer tables LMFE needs (built once:
about a second for a 49k vocabulary). ``compile`` validates a spec and returns a factory; each
sequence gets a ``_Mask`` that wraps its own ``TokenEnforcer``.

LMFE's JSON support has gaps; this module closes the ones that would produce invalid JSON or
a stuck generation, and refuses (400) what it cannot enforce:

- schemas are checked against their meta-schema (when ``jsonschema`` is installed), then
  normalized into the subset LMFE's parser handles (``{}``/``true`` -> any value, a type list
  -> ``anyOf``, ``oneOf`` -> ``anyOf``, ``allOf`` merged, missing ``type`` inferred, sibling
  keywords of ``anyOf`` pushed into its branches), and every sub-schema is built once;
- integers never take a fraction or an exponent, ``1.e5`` is refused, numbers take at most
  16 digits before and 16 after the point and 3 in the exponent, objects take no
  trailing comma, and whitespace right after a string's opening quote counts towards its
  length (strict versions of LMFE's number, object and string states, which LMFE's
  ``get_parser`` is patched once per process to build);
- JSON strings never contain raw control characters (LMFE's free-text token table allows
  tokens with tabs, which ``json.loads`` rejects);
- tokens that hold only part of a UTF-8 character (LMFE counts their bytes as characters and
  then loses track of the parse) are used only inside JSON strings without
  ``minLength``/``maxLength``, where any character is fine.

JSON is compact (``GuidedSpec.compact``, the default): no whitespace outside strings, so once
the value is complete only end-of-sequence is allowed (``_CompactJson``), and no run of
whitespace inside them (a free-text table without such tokens, and ``_Spacing``). LMFE's knob,
``CharacterLevelParserConfig.max_consecutive_whitespaces``, cannot express this: it counts
whitespace in strings and structure alike, and ``TokenEnforcer`` replaces the parser's config
with a default one anyway.

Not enforced (accepted and ignored): ``minimum``/``maximum``/``exclusive*``/``multipleOf``,
``uniqueItems``, ``format``, ``patternProperties``, ``not``, ``if``/``then``/``else``,
``minProperties``/``maxProperties``. Arrays without ``maxItems`` hold at most 20 items; with
``compact=False`` at most 12 whitespace characters follow each other (LMFE's defaults).
"""

from __future__ import annotations

import copy
import logging
import re
import time
from typing import Any, Callable

from lmformatenforcer import JsonSchemaParser, RegexParser, TokenEnforcer, TokenEnforcerTokenizerData
from lmformatenforcer.characterlevelparser import UnionParser
from lmformatenforcer import jsonschemaparser as _jsp
from lmformatenforcer.consts import WHITESPACE_CHARACTERS
from lmformatenforcer.tokenizerprefixtree import JsonFreetextTokenCache
from lmformatenforcer.tokenlist import TokenList

from llmserve import InvalidRequestError
from llmserve import GuidedDecoder, GuidedSpec

from .automata import ChoiceParser, choice_trie, regex_context, regex_index
from .schema import compile_regex, prepare_schema_context
from .structure import StructEnforcer, StructParser, Tables, compile_structure, special_atoms

log = logging.getLogger("llmserve.guided.lmfe")

_PARTIAL = "\ufffd"  # what a token that is only part of a UTF-8 character decodes to
_UNBOUNDED = 1 << 40
_WS_RUN = re.compile(r"\s\s")
_NUMBER_DIGITS = 16  # most digits before, and after, a number's decimal point
_EXP_DIGITS = 3
_MAX_FREE_DEPTH = 4  # compact JSON: containers nest deeper only where the schema requires one


# -- LMFE fixes ----------------------------------------------------------------------------------
class _StrictNumber(_jsp.NumberParsingState):
    """LMFE's number state without its invalid outputs: no '.' or exponent in integers
    (LMFE allows ``1e-5`` and ``-0.5`` there), and no exponent right after a '.' (``1.e5``)."""

    def _clone(self) -> "_StrictNumber":
        clone = super()._clone()
        clone.__class__ = _StrictNumber
        return clone

    def get_allowed_characters(self) -> str:
        chars = super().get_allowed_characters()
        if not self.allow_floating_point:
            chars = "".join(c for c in chars if c not in ".eE")
        elif self.parsed_string.endswith("."):
            chars = "".join(c for c in chars if c not in "eE")
        if self._digits_left() <= 0:
            chars = "".join(c for c in chars if not c.isdigit())
        return chars

    def _digits_left(self) -> int:
        """Digits the current part of the number may still take: a small model otherwise
        writes digits until max_tokens (beyond 16 they carry no precision in a double)."""
        text = self.parsed_string.strip().lstrip("-")
        if self.seen_exponent:
            return _EXP_DIGITS - len(text.rpartition("e" if "e" in text else "E")[2].lstrip("+-"))
        return _NUMBER_DIGITS - len(text.rpartition(".")[2])


class _StrictObject(_jsp.ObjectParsingState):
    """LMFE's object state without trailing commas (after ``,`` a key must follow), whose key
    parsers are strict strings too."""

    def clone(self) -> "_StrictObject":
        clone = super().clone()
        clone.__class__ = _StrictObject
        return clone

    def add_character(self, new_character: str) -> Any:
        result = super().add_character(new_character)
        stack = self.root.context.active_parser.object_stack
        if stack and type(stack[-1]) is _jsp.StringParsingState:  # a key parser was just pushed
            stack[-1].__class__ = _StrictString
        return result

    def get_allowed_characters(self) -> str:
        chars = super().get_allowed_characters()
        if self.current_stage == _jsp.ObjectParsingStage.PARSING_KEY_OR_END and self.existing_keys:
            return chars.replace("}", "")
        return chars


class _OpenText(str):
    """The characters a free JSON string takes next: these, or any other character that needs
    no escape (multi-byte characters arrive in pieces and need not be in the alphabet)."""

    def __contains__(self, c: object) -> bool:
        return str.__contains__(self, c) or (isinstance(c, str) and len(c) == 1 and c >= " " and c not in '"\\')


class _StrictString(_jsp.StringParsingState):
    """LMFE's string state, counting whitespace right after the opening quote (LMFE drops it,
    so ``" abc"`` passed a ``maxLength`` of 3) and taking any character in free text (LMFE
    takes only its alphabet, and breaks on other characters the tokens spell)."""

    def get_allowed_characters(self) -> str:
        chars = super().get_allowed_characters()
        if (self.require_opening_quote and self.seen_opening_quote and not self.seen_closing_quote
                and not self.regex_parser and not self.allowed_strings
                and (self.max_length is None or len(self.parsed_string) < self.max_length)):
            return _OpenText(chars)
        return chars

    def _clone(self) -> "_StrictString":
        clone = super()._clone()
        clone.__class__ = _StrictString
        return clone

    def add_character(self, new_character: str) -> Any:
        if (new_character in WHITESPACE_CHARACTERS and not self.parsed_string and self.require_opening_quote
                and self.seen_opening_quote and not self.seen_closing_quote):
            new = self._clone()
            new.parsed_string = new_character
            if new.regex_parser:
                new.regex_parser = new.regex_parser.add_character(new_character)
            return new
        return super().add_character(new_character)


_STRICT = {_jsp.NumberParsingState: _StrictNumber, _jsp.ObjectParsingState: _StrictObject,
           _jsp.StringParsingState: _StrictString}


def _own_regex_cache(self: Any) -> None:
    self.regex_parser_cache = {}


def _install_fixes() -> None:
    """Make LMFE's JSON parser build the strict states above, and give each parser context its
    own cache of string-pattern automata (LMFE's is one class-level dict that only grows: every
    pattern any request ever sent, kept for the life of the process). Once per process."""
    if getattr(_jsp.get_parser, "_llmserve_strict", False):
        return
    _jsp.JsonSchemaParser._Context.__init__ = _own_regex_cache  # type: ignore[method-assign]
    original = _jsp.get_parser

    def get_parser(parsing_state: Any, value_schema: Any) -> Any:
        parser = original(parsing_state, value_schema)  # recursion goes through this wrapper too
        for p in [parser, *getattr(parser, "parsers", ())]:
            if type(p) in _STRICT:
                p.__class__ = _STRICT[type(p)]
        return parser

    get_parser._llmserve_strict = True  # type: ignore[attr-defined]
    _jsp.get_parser = get_parser


_install_fixes()


def _in_string(stack: list[Any]) -> bool:
    """Whether the top of a JSON parser's stack is inside a quoted string."""
    top = stack[-1] if stack else None
    for p in top.parsers if isinstance(top, UnionParser) else [top]:
        if (isinstance(p, _jsp.StringParsingState) and p.require_opening_quote and p.seen_opening_quote
                and not p.seen_closing_quote):
            return True
    return False


class _CompactJson(JsonSchemaParser):
    """LMFE's JSON parser allowing no whitespace outside strings: none between tokens, and
    none after the value, so once the value is complete only end-of-sequence is allowed."""

    def add_character(self, new_character: str) -> Any:
        return _compact(super().add_character(new_character))

    def get_allowed_characters(self) -> str:
        chars = super().get_allowed_characters()
        if _in_string(self.object_stack):
            return chars
        if getattr(self, "scalar_sibling", False) and sum(map(_is_container, self.object_stack)) > _MAX_FREE_DEPTH:
            return ""  # a value that may be a scalar is one this deep (greedy small models nest forever)
        return "".join(c for c in chars if c not in WHITESPACE_CHARACTERS)


def _is_container(state: Any) -> bool:
    return isinstance(state, (_jsp.ObjectParsingState, _jsp.ListParsingState))


def _compact(parser: Any) -> Any:
    """Make the JSON parsers LMFE just built (one, or the options of a union) compact."""
    if type(parser) is JsonSchemaParser:
        parser.__class__ = _CompactJson
    elif isinstance(parser, UnionParser):
        tops = [p.object_stack[-1] if isinstance(p, JsonSchemaParser) and p.object_stack else None
                for p in parser.parsers]
        scalar = not all(map(_is_container, tops))
        for option, top in zip(parser.parsers, tops):
            _compact(option)
            if scalar and _is_container(top):  # an object or array option of a value that may be a scalar
                option.scalar_sibling = True
    return parser


# -- tokenizer tables ----------------------------------------------------------------------------
def _decode_fn(tokenizer: Any) -> Callable[[list[int]], str]:
    try:
        tokenizer.decode([0], clean_up_tokenization_spaces=False)
    except TypeError:
        return tokenizer.decode
    return lambda ids: tokenizer.decode(ids, clean_up_tokenization_spaces=False)


def build_tokenizer_data(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> TokenEnforcerTokenizerData:
    """LMFE's per-tokenizer tables, for any tokenizer with ``encode``/``decode`` (LMFE's own
    transformers builder does not import with transformers 5)."""
    decode = _decode_fn(tokenizer)
    n = min(vocab_size, len(tokenizer))
    special = set(getattr(tokenizer, "all_special_ids", None) or ()) | set(eos_token_ids)
    zero = tokenizer.encode("0", add_special_tokens=False)[-1]
    regular, partial = [], []
    for i in range(n):
        if i in special:
            continue
        # After "0", a token that starts a word shows its leading space (sentencepiece drops it alone).
        text = decode([zero, i])[1:]
        if _PARTIAL in text:  # LMFE would count its bytes as characters: see _FreetextCache
            partial.append((i, text))
        elif text:  # a token that decodes to nothing would be allowed everywhere, forever
            regular.append((i, text, len(text) > len(decode([i]))))
    data = TokenEnforcerTokenizerData(regular, lambda ids: decode(ids).rstrip(_PARTIAL), list(eos_token_ids), False, n)
    data.partial_tokens = partial
    return data


class _FreetextCache(JsonFreetextTokenCache):
    """LMFE's table of tokens allowed inside a JSON string, with two fixes: no raw control
    characters (invalid in JSON), and tokens holding part of a multi-byte character only in
    strings without minLength/maxLength (LMFE cannot count their characters; anywhere else
    in a string any character is fine). Other strings, regexes and structure use only tokens
    of whole characters. ``compact`` leaves out tokens that hold a run of whitespace."""

    def __init__(self, data: TokenEnforcerTokenizerData, compact: bool = False) -> None:
        super().__init__(False, data.vocab_size)
        for idx, text, _ in data.regular_tokens:
            if all(c >= " " for c in text) and not (compact and _WS_RUN.search(text)):
                self.add_token(text, idx)
        self.freeze()
        self.limit = self.max_token_len
        self.max_token_len = _UNBOUNDED  # so a lookup can tell "no maxLength" from "far from it"
        self.unbounded = TokenList(False, data.vocab_size)
        self.unbounded.extend(super().lookup_allowed_tokens(0, self.limit).allowed_tokens)
        self.unbounded.extend(i for i, text in getattr(data, "partial_tokens", ())
                              if all(c >= " " and c not in '"\\' for c in text)
                              and not (compact and _WS_RUN.search(text)))

    def lookup_allowed_tokens(self, min_remaining: int, max_len: int) -> TokenList:
        if min_remaining == 0 and max_len >= _UNBOUNDED:
            return self.unbounded
        return super().lookup_allowed_tokens(min(min_remaining, self.limit), min(max_len, self.limit))


def _json_tokenizer_data(data: TokenEnforcerTokenizerData, compact: bool) -> TokenEnforcerTokenizerData:
    """A view of ``data`` for JSON (see ``_FreetextCache``)."""
    tree = copy.copy(data.tokenizer_tree)
    tree.json_freetext_tokens = _FreetextCache(data, compact)  # only JSON parsers read it
    view = object.__new__(TokenEnforcerTokenizerData)
    view.__dict__.update(data.__dict__)
    view.tokenizer_tree = tree
    view.tokenizer_alphabet = "".join(c for c in data.tokenizer_alphabet if c >= " ")
    return view


# -- masks ---------------------------------------------------------------------------------------
class _Mask:
    """One sequence's constraint state. LMFE keys states by the whole token sequence; we feed it
    a fixed one-token "prompt" plus the output, keep only the newest state, and replay when the
    output did not grow by exactly one token. ``spacing`` (compact JSON) takes out the tokens
    that start with whitespace after a token that ends with it."""

    __slots__ = ("_enforcer", "_prompt", "_key", "_allowed", "_eos", "_failed", "_spacing")

    def __init__(self, data: TokenEnforcerTokenizerData, parser: Any, eos: list[int],
                 token_cache: dict | None = None, spacing: "_Spacing | None" = None,
                 enforcer: type[TokenEnforcer] = TokenEnforcer) -> None:
        self._enforcer = enforcer(data, parser)
        self._spacing = spacing
        if token_cache is not None:  # allowed tokens per parser state, shared by the factory's masks
            self._enforcer.allowed_token_cache = token_cache
        self._prompt = (eos[0] if eos else 0,)
        self._key: tuple[int, ...] | None = None
        self._allowed: list[int] = []
        self._eos = eos
        self._failed = False

    def allowed(self, output_token_ids: list[int]) -> list[int] | None:
        key = self._prompt + tuple(output_token_ids)
        if key == self._key or self._failed:
            return self._allowed
        enforcer, last = self._enforcer, self._key
        try:
            if last is None or len(key) <= len(last) or key[:len(last)] != last:
                enforcer.prefix_states.clear()
                start = len(self._prompt)
            else:
                start = len(last) + 1
            for end in range(start, len(key)):
                enforcer.get_allowed_tokens(key[:end])
            allowed = enforcer.get_allowed_tokens(key).allowed_tokens
            if self._spacing is not None:
                allowed = self._spacing.filter(allowed, output_token_ids)
        except Exception as exc:  # noqa: BLE001 - never take the engine down: end the sequence
            log.warning("guided decoding stopped a sequence: %s: %s", type(exc).__name__, exc)
            allowed, self._failed = list(self._eos), True
        for k in [k for k in enforcer.prefix_states if k != key]:
            del enforcer.prefix_states[k]
        self._key, self._allowed = key, allowed
        return allowed


class _StateCache(dict):
    """LMFE's per-state allowed-token cache, bounded (a regex can have many states)."""

    limit = 256

    def __setitem__(self, key: Any, value: Any) -> None:
        if len(self) >= self.limit:
            self.clear()
        super().__setitem__(key, value)


class _Spacing:
    """Keeps whitespace in compact JSON strings single across tokens (LMFE's free-text shortcut
    takes string tokens whole, without looking at the text before them; runs inside one token
    are out of the compact free-text table)."""

    __slots__ = ("starts", "ends")

    def __init__(self, data: TokenEnforcerTokenizerData) -> None:
        tokens = [(t[0], t[1]) for t in data.regular_tokens] + list(getattr(data, "partial_tokens", ()))
        self.starts = frozenset(i for i, text in tokens if text[:1].isspace())
        self.ends = frozenset(i for i, text in tokens if text[-1:].isspace())

    def filter(self, allowed: list[int], output_token_ids: list[int]) -> list[int]:
        if not output_token_ids or output_token_ids[-1] not in self.ends:
            return allowed
        return [t for t in allowed if t not in self.starts] or allowed  # never a constraint's only way on


class _Factory:
    __slots__ = ("data", "make_parser", "eos", "spec", "token_cache", "spacing", "enforcer")

    def __init__(self, data: Any, make_parser: Callable[[], Any], eos: list[int], spec: GuidedSpec,
                 spacing: _Spacing | None = None, token_cache: dict | None = None,
                 enforcer: type[TokenEnforcer] = TokenEnforcer) -> None:
        self.data, self.make_parser, self.eos, self.spec = data, make_parser, eos, spec
        # A complete index (regexes) is kept whole; otherwise a bounded cache filled as states are met.
        self.token_cache = _StateCache() if token_cache is None else token_cache
        self.spacing = spacing
        self.enforcer = enforcer

    def __call__(self) -> _Mask:
        return _Mask(self.data, self.make_parser(), self.eos, self.token_cache, self.spacing, self.enforcer)

    def __repr__(self) -> str:
        return f"<lm-format-enforcer {self.spec.kind} mask factory>"


# -- the decoder ---------------------------------------------------------------------------------
class LMFormatEnforcerDecoder(GuidedDecoder):
    """JSON schemas, JSON objects, regular expressions, choice lists and structures (forced tool
    calls in a family's own syntax, ``structure.py``) via lm-format-enforcer."""

    name = "lm-format-enforcer"
    kinds = frozenset({"json_schema", "json_object", "regex", "choice", "structure"})

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        started = time.perf_counter()
        self.data = build_tokenizer_data(tokenizer, vocab_size, self.eos_token_ids)
        self.compact_data = _json_tokenizer_data(self.data, compact=True)
        self.spaced_data = _json_tokenizer_data(self.data, compact=False)
        self.spacing = _Spacing(self.data)
        self.tables = Tables(self.compact_data, special_atoms(tokenizer, self.data, self.eos_token_ids))
        self.build_seconds = time.perf_counter() - started
        log.info("lm-format-enforcer: tokenizer tables for %d tokens built in %.2fs",
                 len(self.data.regular_tokens), self.build_seconds)

    def compile(self, spec: GuidedSpec) -> _Factory:
        param = spec.param or spec.kind
        if spec.kind in ("json_schema", "json_object"):
            schema = {"type": "object"} if spec.kind == "json_object" else spec.value
            # Parsed once, here: the masks share the context (sub-schemas, pattern automata).
            context = prepare_schema_context(schema, spec.param)[1]
            if not spec.compact:
                return _Factory(self.spaced_data, lambda: JsonSchemaParser(context), self.eos_token_ids, spec)
            return _Factory(self.compact_data, lambda: _CompactJson(context), self.eos_token_ids, spec, self.spacing)
        if spec.kind == "structure":
            program = compile_structure(spec.value, self.tables, spec.param, _CompactJson)
            return _Factory(self.compact_data, lambda: StructParser(program), self.eos_token_ids, spec,
                            enforcer=StructEnforcer)
        if spec.kind == "choice":
            trie = choice_trie(list(spec.value))
            return _Factory(self.data, lambda: ChoiceParser(trie), self.eos_token_ids, spec)
        if spec.kind != "regex":
            raise InvalidRequestError(f"{param}: lm-format-enforcer does not support {spec.kind}", param=spec.param)
        context = regex_context(compile_regex(spec.value, param, spec.param))
        index = regex_index(self.data, context, self.eos_token_ids)
        return _Factory(self.data, lambda: RegexParser(context), self.eos_token_ids, spec, token_cache=index)
