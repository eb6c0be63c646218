"""The ``structure`` kind for the lm-format-enforcer decoder: an output described piece by piece
(``llmserve.guided.structure``), the forced tool calls of a family in its own syntax.

A structure compiles into a small program of nodes; a ``StructParser`` is one LMFE character
parser over it: the set of places the output may be at (a leaf state and what follows it), so
alternatives and repetitions cost no backtracking. Leaves:

- literal text, character by character; a part of it that is the text of one of the
  tokenizer's special tokens (``<|channel|>``) is an atom: only that token writes it;
- a JSON value: LMFE's compact JSON parser over the schema (prepared once, like ``json_schema``);
- free text: any characters, up to ``max_length``, that never complete one of its ``without``
  strings (JSON leaves may take a ``without`` list too).

``StructEnforcer`` is LMFE's ``TokenEnforcer`` with three additions: atoms are allowed as
their token id (they are not in LMFE's tables of regular tokens); in free text the tokens that
keep the text free (none of its ``without`` strings inside, not longer than the room) come
from a table built once per ``without`` list, and only the characters another place can take
are walked in the tokenizer's prefix tree (walking it for free text visits every token); and a
state whose places are all literal or free text is cached by its key.
"""

from __future__ import annotations

import bisect
import json
from typing import Any

from lmformatenforcer import TokenEnforcer
from lmformatenforcer.characterlevelparser import CharacterLevelParser, CharacterLevelParserConfig, ForceStopParser
from lmformatenforcer.jsonschemaparser import NumberParsingState
from lmformatenforcer.tokenlist import TokenList

from llmserve import check_deadline

from .schema import prepare_schema_context

MAX_PLACES = 4096  # places one state may hold; past it the sequence ends (a structure that explodes)
END = ("end",)


class Program:
    """A compiled structure: ``nodes[i]`` is ``(kind, ...)``; node 0 is the root."""

    def __init__(self, tables: "Tables") -> None:
        self.nodes: list[tuple] = []
        self.tables = tables
        self.config = CharacterLevelParserConfig()
        self.json_contexts: dict[str, Any] = {}
        self.make_json: Any = None

    def add(self, node: tuple) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1


def compile_structure(value: dict, tables: "Tables", param: str | None, make_json: Any) -> Program:
    """The program of a checked structure (``check_structure`` ran first). ``make_json(context)``
    builds a compact JSON parser over a prepared schema context."""
    program = Program(tables)
    program.make_json = make_json
    program.add(("seq", []))  # the root, filled below
    root = _node(program, value, param)
    program.nodes[0] = ("seq", [root])
    return program


def _node(program: Program, node: dict, param: str | None) -> int:
    check_deadline()
    if "text" in node:
        parts = [program.add(("atom", text, tid) if tid is not None else ("text", text))
                 for text, tid in program.tables.split(node["text"])]
        return program.add(("seq", parts))
    if "json" in node:
        key = json.dumps(node["json"], sort_keys=True)
        if key not in program.json_contexts:
            program.json_contexts[key] = prepare_schema_context(node["json"], param)[1]
        return program.add(("json", program.json_contexts[key], Watch.of(node.get("without", []))))
    if "free_text" in node:
        body = node["free_text"]
        return program.add(("free", Watch.of(body.get("without", [])), body.get("min_length", 0),
                            body.get("max_length")))
    if "sequence" in node:
        return program.add(("seq", [_node(program, p, param) for p in node["sequence"]]))
    if "one_of" in node:
        return program.add(("any", [_node(program, p, param) for p in node["one_of"]]))
    sep = node.get("separator")
    return program.add(("rep", _node(program, node["repeat"], param), node["min"], node["max"],
                        _node(program, sep, param) if sep is not None else None))


class Watch:
    """Strings a text may not contain: ``step(tail, c)`` is the new tail (the longest end of the
    text that begins one of them), or None when ``c`` completes one."""

    __slots__ = ("words", "firsts", "longest")

    def __init__(self, words: tuple[str, ...]) -> None:
        self.words = words
        self.firsts = frozenset(w[0] for w in words)
        self.longest = max(map(len, words), default=0)

    @staticmethod
    def of(words: list[str]) -> "Watch":
        return Watch(tuple(dict.fromkeys(words)))

    def step(self, tail: str, c: str) -> str | None:
        if not tail and c not in self.firsts:
            return ""
        s = tail + c
        if any(s.endswith(w) for w in self.words):
            return None
        for k in range(min(len(s), self.longest - 1), 0, -1):
            end = s[-k:]
            if any(w.startswith(end) for w in self.words):
                return end
        return ""

    def remainders(self, tail: str) -> set[str]:
        """What would complete a word after ``tail``: a token starting with one of these does."""
        return {w[k:] for w in self.words for k in range(1, min(len(tail), len(w) - 1) + 1)
                if w.startswith(tail[-k:])}

    def completing(self, tail: str) -> set[str]:
        """The characters that would complete a word after ``tail``."""
        return {w[-1] for w in self.words if (tail + w[-1]).endswith(w)}


class Tables:
    """What structures need from one tokenizer, built once per decoder: the special tokens
    (atoms) by text, and per ``without`` list the regular tokens that contain none of its words,
    ordered by length."""

    def __init__(self, data: Any, atoms: dict[str, int]) -> None:
        self.data = data
        self.atoms = atoms
        self.atom_text = {tid: text for text, tid in atoms.items()}
        self._firsts: dict[str, list[str]] = {}
        for text in sorted(atoms, key=len, reverse=True):
            self._firsts.setdefault(text[0], []).append(text)
        self._free: dict[tuple[str, ...], tuple[list[int], list[int], frozenset[int]]] = {}

    def split(self, text: str) -> list[tuple[str, int | None]]:
        """``text`` as plain runs and atoms (longest special-token text first)."""
        out: list[tuple[str, int | None]] = []
        i, run = 0, 0
        while i < len(text):
            hit = next((a for a in self._firsts.get(text[i], ()) if text.startswith(a, i)), None)
            if hit is None:
                i += 1
                continue
            if i > run:
                out.append((text[run:i], None))
            out.append((hit, self.atoms[hit]))
            i = run = i + len(hit)
        if run < len(text) or not out:
            out.append((text[run:], None))
        return out

    def free(self, words: tuple[str, ...]) -> tuple[list[int], list[int], frozenset[int]]:
        """``(lengths, ids, bad)``: the tokens without any of ``words``, by length, and the others."""
        hit = self._free.get(words)
        if hit is None:
            good = sorted((len(text), i) for i, text, _ in self.data.regular_tokens
                          if not any(w in text for w in words))
            bad = frozenset(i for i, text, _ in self.data.regular_tokens if any(w in text for w in words))
            hit = ([n for n, _ in good], [i for _, i in good], bad)
            if len(self._free) >= 64:
                self._free.clear()
            self._free[words] = hit
        return hit


# -- leaf states ---------------------------------------------------------------------------------
class Text:
    __slots__ = ("node", "text", "pos", "atom")

    def __init__(self, node: int, text: str, pos: int, atom: int | None) -> None:
        self.node, self.text, self.pos, self.atom = node, text, pos, atom

    def chars(self, program: Program) -> str:
        return "" if self.atom is not None and self.pos == 0 else self.text[self.pos]

    def add(self, c: str) -> "Text | None":
        if self.atom is not None:  # written only as its token (StructParser.add_atom)
            return None
        return Text(self.node, self.text, self.pos + 1, self.atom) if self.text[self.pos] == c else None

    def done(self) -> bool:
        return self.pos >= len(self.text)

    def can_end(self) -> bool:
        return False

    def key(self) -> tuple:
        return (self.node, self.pos)


class Free:
    __slots__ = ("node", "watch", "low", "high", "tail", "length")

    def __init__(self, node: int, watch: Watch, low: int, high: int | None, tail: str, length: int) -> None:
        self.node, self.watch, self.low, self.high, self.tail, self.length = node, watch, low, high, tail, length

    def chars(self, program: Program) -> str:
        if self.high is not None and self.length >= self.high:
            return ""
        stop = self.watch.completing(self.tail)
        alphabet = program.config.alphabet
        return "".join(c for c in alphabet if c not in stop) if stop else alphabet

    def add(self, c: str) -> "Free | None":
        if self.high is not None and self.length >= self.high:
            return None
        tail = self.watch.step(self.tail, c)
        if tail is None:
            return None
        return Free(self.node, self.watch, self.low, self.high, tail, self.length + 1)

    def done(self) -> bool:
        return self.high is not None and self.length >= self.high

    def can_end(self) -> bool:
        return self.length >= self.low

    def key(self) -> tuple:
        length = self.length if self.high is not None else min(self.length, self.low)
        return (self.node, self.tail, length)


class Json:
    __slots__ = ("node", "parser", "watch", "tail")

    def __init__(self, node: int, parser: Any, watch: Watch, tail: str) -> None:
        self.node, self.parser, self.watch, self.tail = node, parser, watch, tail

    def chars(self, program: Program | None) -> str:
        chars = self.parser.get_allowed_characters()
        stop = set(self.watch.completing(self.tail)) if self.watch.words else set()
        stack = getattr(self.parser, "object_stack", None)
        if stack and isinstance(stack[-1], NumberParsingState):
            stop |= {"e", "E"}  # plain decimals: an exponent may overflow (1e999), which no reader takes back
        return "".join(c for c in chars if c not in stop) if stop else chars

    def add(self, c: str) -> "Json | None":
        if c not in self.chars(None):
            return None
        tail = self.watch.step(self.tail, c) if self.watch.words else ""
        if tail is None:
            return None
        return Json(self.node, self.parser.add_character(c), self.watch, tail)

    def done(self) -> bool:
        return False

    def can_end(self) -> bool:
        return self.parser.can_end()

    def key(self) -> None:
        return None


# -- the parser ----------------------------------------------------------------------------------
class StructParser(CharacterLevelParser):
    """The places the output may be at: ``(leaf, continuation)`` pairs, ``END`` once complete.
    A continuation is a linked tuple ``(frame, rest)``: ``("s", seq, i)`` (the sequence goes on
    at part ``i``), ``("r", rep, n)`` (``n`` repetitions done), ``("p", rep, n)`` (a separator
    done)."""

    def __init__(self, program: Program, places: tuple | None = None) -> None:
        self.program = program
        if places is None:
            out: list = []
            self._expand(0, (), out)
            places = tuple(out)
        self.places = places

    @property
    def config(self) -> CharacterLevelParserConfig:
        return self.program.config

    @config.setter
    def config(self, new_config: CharacterLevelParserConfig) -> None:
        self.program.config = new_config
        for context in self.program.json_contexts.values():  # LMFE set it from its default alphabet
            context.alphabet_without_quotes = new_config.alphabet.replace('"', "")

    # -- places ---------------------------------------------------------------------------
    def _expand(self, i: int, cont: tuple, out: list) -> None:
        if len(out) > MAX_PLACES:
            raise ValueError("the structure has too many places at once")
        node = self.program.nodes[i]
        kind = node[0]
        if kind in ("text", "atom"):
            self._place(Text(i, node[1], 0, node[2] if kind == "atom" else None), cont, out)
        elif kind == "json":
            parser = self.program.make_json(node[1])
            parser.config = self.program.config
            out.append((Json(i, parser, node[2], ""), cont))
        elif kind == "free":
            self._place(Free(i, node[1], node[2], node[3], "", 0), cont, out)
        elif kind == "seq":
            self._follow((("s", i, 0), cont), out)
        elif kind == "any":
            for option in node[1]:
                self._expand(option, cont, out)
        else:
            self._expand(node[1], (("r", i, 1), cont), out)
            if node[2] == 0:
                self._follow(cont, out)

    def _follow(self, cont: tuple, out: list) -> None:
        if not cont:
            out.append((END, ()))
            return
        (kind, i, n), rest = cont
        node = self.program.nodes[i]
        if kind == "s":
            if n < len(node[1]):
                self._expand(node[1][n], (("s", i, n + 1), rest), out)
            else:
                self._follow(rest, out)
        elif kind == "p":
            self._expand(node[1], (("r", i, n + 1), rest), out)
        else:
            _, item, low, high, sep = node
            if n < high:
                if sep is not None:
                    self._expand(sep, (("p", i, n), rest), out)
                else:
                    self._expand(item, (("r", i, n + 1), rest), out)
            if n >= low:
                self._follow(rest, out)

    def _place(self, leaf: Any, cont: tuple, out: list) -> None:
        if not leaf.done():
            out.append((leaf, cont))
        if leaf.done() or leaf.can_end():
            self._follow(cont, out)

    # -- LMFE's interface -----------------------------------------------------------------
    def add_character(self, new_character: str) -> "StructParser":
        out: list = []
        for leaf, cont in self.places:
            if leaf is END:
                continue
            moved = leaf.add(new_character)
            if moved is not None:
                self._place(moved, cont, out)
        if not out:
            raise ValueError(f"{new_character!r} does not fit the structure here")
        return StructParser(self.program, _unique(out))

    def add_atom(self, token_id: int) -> "StructParser":
        """The special token ``token_id`` written where an atom of it is expected."""
        out: list = []
        for leaf, cont in self.places:
            if isinstance(leaf, Text) and leaf.atom == token_id and leaf.pos == 0:
                self._place(Text(leaf.node, leaf.text, len(leaf.text), token_id), cont, out)
        if not out:
            raise ValueError(f"token {token_id} does not fit the structure here")
        return StructParser(self.program, _unique(out))

    def get_allowed_characters(self) -> str:
        chars = {c for leaf, _ in self.places if leaf is not END for c in leaf.chars(self.program)}
        return "".join(chars)

    def can_end(self) -> bool:
        return any(leaf is END for leaf, _ in self.places)

    def atoms(self) -> list[int]:
        return [leaf.atom for leaf, _ in self.places
                if isinstance(leaf, Text) and leaf.atom is not None and leaf.pos == 0]

    def cache_key(self) -> tuple | None:
        keys = []
        for leaf, cont in self.places:
            key = END if leaf is END else leaf.key()
            if key is None:
                return None
            keys.append((key, cont))
        return ("structure", tuple(keys))

    def shortcut_key(self) -> tuple | None:
        """``("free", place)``: one free-text place outside a possible word; ``("json", key,
        words)``: a lone JSON place in a free string (LMFE's own shortcut, minus the tokens
        holding a word)."""
        free = [p for p in self.places if isinstance(p[0], Free)]
        if len(free) == 1 and not free[0][0].done():
            return ("free", free[0])
        if len(self.places) == 1 and isinstance(self.places[0][0], Json):
            key = self.places[0][0].parser.shortcut_key()
            if key is not None:
                return ("json", key, self.places[0][0])
        return None


def _unique(places: list) -> tuple:
    seen: set = set()
    out = []
    for leaf, cont in places:
        key = id(leaf) if isinstance(leaf, Json) else (END if leaf is END else leaf.key(), cont)
        if key not in seen:
            seen.add(key)
            out.append((leaf, cont))
    return tuple(out)


class StructEnforcer(TokenEnforcer):
    """LMFE's token enforcer for structures (module doc)."""

    def _compute_allowed_tokens(self, state_tokens: tuple, state: Any) -> None:
        parser = state.parser
        key = parser.cache_key() if isinstance(parser, StructParser) else None
        if key is not None and key in self.allowed_token_cache:
            state.allowed_tokens = self.allowed_token_cache[key]
            return
        allowed = TokenList(False, self.vocab_size)
        if isinstance(parser, StructParser):
            self._collect(parser, allowed)
            allowed.extend(parser.atoms())
        eos = self.eos_token_id if isinstance(self.eos_token_id, list) else [self.eos_token_id]
        if parser.can_end() or not allowed.allowed_tokens:  # complete, or a dead end: the sequence ends
            allowed.extend(eos)
        allowed.allowed_tokens = list(dict.fromkeys(allowed.allowed_tokens))
        state.allowed_tokens = allowed
        if key is not None:
            self.allowed_token_cache[key] = allowed

    def _collect(self, parser: StructParser, allowed: TokenList) -> None:
        root = self.tokenizer_tree.root
        shortcut = parser.shortcut_key()
        if shortcut is None:
            self._collect_allowed_tokens(parser, root, allowed, None)
            return
        tables = parser.program.tables
        if shortcut[0] == "json":
            found = TokenList(False, self.vocab_size)
            self._collect_allowed_tokens(parser, root, found, shortcut[1])
            leaf = shortcut[2]
            if leaf.watch.words:
                banned = tables.free(leaf.watch.words)[2] | self._starting(leaf.watch.remainders(leaf.tail))
                allowed.extend(t for t in found.allowed_tokens if t not in banned)
            else:
                allowed.extend(found.allowed_tokens)
            return
        leaf, cont = shortcut[1]
        lengths, ids, _ = tables.free(leaf.watch.words)
        room = len(ids) if leaf.high is None else bisect.bisect_right(lengths, leaf.high - leaf.length)
        if leaf.tail:  # a word begun: the tokens that would finish it are out
            banned = self._starting(leaf.watch.remainders(leaf.tail))
            allowed.extend(t for t in ids[:room] if t not in banned)
        else:
            allowed.extend(ids[:room])
        others = {c for other, _ in parser.places if other is not END and other is not leaf
                  for c in other.chars(parser.program)}
        for c in others.intersection(root.children):
            self._collect_allowed_tokens(parser.add_character(c), root.children[c], allowed, None)

    def _starting(self, prefixes: set[str]) -> set[int]:
        """The regular tokens whose text starts with one of ``prefixes``."""
        out: set[int] = set()
        for prefix in prefixes:
            node = self.tokenizer_tree.root
            for c in prefix:
                node = node.children.get(c)
                if node is None:
                    break
            stack = [node] if node is not None else []
            while stack:
                node = stack.pop()
                out.update(node.tokens)
                stack.extend(node.children.values())
        return out

    def _apply_new_characters(self, state: Any, token_sequence: list[int]) -> Any:
        parser, token = state.parser, token_sequence[-1]
        if not isinstance(parser, StructParser) or token not in parser.program.tables.atom_text:
            return super()._apply_new_characters(state, token_sequence)
        try:
            return TokenEnforcer.OutputTensorState(parser=parser.add_atom(token))
        except ValueError:
            return TokenEnforcer.OutputTensorState(parser=ForceStopParser())


def special_atoms(tokenizer: Any, data: Any, eos_token_ids: list[int]) -> dict[str, int]:
    """Text -> id of the tokens LMFE's regular table leaves out (special tokens, end-of-sequence
    ids, added special tokens): what literal text may only be written as."""
    regular = {i for i, _, _ in data.regular_tokens}
    ids = set(getattr(tokenizer, "all_special_ids", None) or ()) | set(eos_token_ids)
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids |= {i for i, tok in added.items() if getattr(tok, "special", False)}
    out: dict[str, int] = {}
    for i in sorted(ids - regular):
        try:
            text = tokenizer.decode([i], skip_special_tokens=False)
        except (ValueError, TypeError, KeyError, IndexError, OverflowError):  # not decodable: no atom
            continue
        if isinstance(text, str) and text.strip() == text and len(text) > 1:
            out.setdefault(text, i)
    return out
