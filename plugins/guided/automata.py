"""Regex and choice constraints for the lm-format-enforcer decoder, prepared so that the engine
thread does almost no work per token.

LMFE finds the tokens a parser state allows by walking the tokenizer's prefix tree, which
costs up to ~0.6 s for a state that allows most of the vocabulary (``.*``): done on the engine
thread, that would stall every other sequence in the batch. A regex's states are few and
known after compiling, so ``regex_index`` computes the allowed tokens of every state on the
compile worker, inside its budget (``check_deadline``), and the masks only look them up.

A choice list becomes a trie (``ChoiceParser``), built in time linear in the choices; an
alternation handed to LMFE's regex library took seconds for a thousand choices.
"""

from __future__ import annotations

from typing import Any

from lmformatenforcer import RegexParser, TokenEnforcerTokenizerData
from lmformatenforcer.characterlevelparser import CharacterLevelParser, CharacterLevelParserConfig
from lmformatenforcer.tokenlist import TokenList

from llmserve import check_deadline


# -- regexes -------------------------------------------------------------------------------------
def regex_context(fsm: Any) -> Any:
    """LMFE's regex parser context around an already built automaton."""
    context = RegexParser._Context()
    context.pattern = fsm
    context.state_character_cache = {}
    context.anything_else_characters = ""
    return context


def regex_index(data: TokenEnforcerTokenizerData, context: Any, eos: list[int]) -> dict[Any, TokenList]:
    """The allowed tokens of every state of the automaton, keyed as LMFE's token cache is (by
    the regex parser's ``cache_key``, the state).

    Walking the tokenizer's prefix tree once per state would take minutes for a regex such as
    ``[^\\n]{0,100}`` (a hundred states that each allow nearly every token). Which tokens a state
    allows depends only on the strings of up to one token's length that can follow it, so states
    are first grouped by those (Moore's refinement, stopped at the longest token): the tree is
    walked once per group, down to ``_SHORT`` characters, and the few longer tokens are checked
    one by one per finer group."""
    RegexParser(context).config = CharacterLevelParserConfig(alphabet=data.tokenizer_alphabet)  # sets the alphabet
    fsm = context.pattern
    states = list(fsm.map)
    longest = max((len(text) for _, text, _ in data.regular_tokens), default=1)
    short_groups, long_groups = _groups(fsm, states, min(_SHORT, longest), longest)
    step = _stepper(fsm)
    short_lists: dict[int, list[int]] = {}
    long_lists: dict[int, list[int]] = {}
    long_tokens = [(i, text) for i, text, _ in data.regular_tokens if len(text) > _SHORT]
    interned: dict[tuple[int, int, bool], TokenList] = {}
    index: dict[Any, TokenList] = {}
    for state in states:
        check_deadline()
        g_short, g_long, final = short_groups[state], long_groups[state], state in fsm.finals
        if g_short not in short_lists:
            short_lists[g_short] = _walk(data.tokenizer_tree.root, state, step, _SHORT)
        if g_long not in long_lists:
            long_lists[g_long] = [i for i, text in long_tokens if _accepts(step, state, text)]
        key = (g_short, g_long, final)
        if key not in interned:
            found = TokenList(False, data.vocab_size)
            found.extend(short_lists[g_short])
            found.extend(long_lists[g_long])
            if final or not found.allowed_tokens:  # a dead end can only end the sequence
                found.extend(eos)
            interned[key] = found
        index[state] = interned[key]
    return index


_SHORT = 16  # tokens up to this many characters are found by walking the prefix tree


def _groups(fsm: Any, states: list[Any], short: int, longest: int) -> tuple[dict[Any, int], dict[Any, int]]:
    """Groups of states that allow the same strings up to ``short`` and ``longest`` characters."""
    group = {s: int(s in fsm.finals) for s in states}
    at_short = group
    count = len(set(group.values()))
    for depth in range(1, longest + 1):
        check_deadline()
        ids: dict[Any, int] = {}
        group = {s: ids.setdefault((group[s], tuple(sorted((t, group.get(n, -1)) for t, n in fsm.map[s].items()))),
                                   len(ids)) for s in states}
        if depth <= short:
            at_short = group
        if len(ids) == count:  # stable: longer strings tell no more states apart
            return (group if depth < short else at_short), group
        count = len(ids)
    return at_short, group


def _stepper(fsm: Any) -> Any:
    """``step(state, char)``: the next state, or None (no way on)."""
    alphabet, table = fsm.alphabet, fsm.map

    def step(state: Any, char: str) -> Any:
        moves = table.get(state)
        return None if moves is None else moves.get(alphabet[char])
    return step


def _accepts(step: Any, state: Any, text: str) -> bool:
    for char in text:
        state = step(state, char)
        if state is None:
            return False
    return True


def _walk(root: Any, start: Any, step: Any, depth: int) -> list[int]:
    """Tokens of at most ``depth`` characters the automaton takes from ``start`` (the prefix
    tree is walked only where the automaton can follow)."""
    out: list[int] = []
    stack = [(root, start, 0)]
    while stack:
        node, state, level = stack.pop()
        out.extend(node.tokens)
        if level == depth:
            continue
        for char, child in node.children.items():
            nxt = step(state, char)
            if nxt is not None:
                stack.append((child, nxt, level + 1))
    return out


# -- choices -------------------------------------------------------------------------------------
class _Node:
    __slots__ = ("children", "end", "chars")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        self.end = False
        self.chars = ""


_DEAD = _Node()


def choice_trie(choices: list[str]) -> _Node:
    """A trie of ``choices``; each node knows the characters that may follow it."""
    root = _Node()
    for choice in choices:
        node = root
        for c in choice:
            nxt = node.children.get(c)
            if nxt is None:
                nxt = node.children[c] = _Node()
            node = nxt
        node.end = True
    stack = [root]
    while stack:
        node = stack.pop()
        node.chars = "".join(node.children)
        stack.extend(node.children.values())
    return root


class ChoiceParser(CharacterLevelParser):
    """Exactly one of the choices in a trie. States are trie nodes, so equal states share
    LMFE's per-state token cache."""

    def __init__(self, node: _Node, config: CharacterLevelParserConfig | None = None) -> None:
        super().__init__(config)
        self.node = node

    def add_character(self, new_character: str) -> "ChoiceParser":
        return ChoiceParser(self.node.children.get(new_character, _DEAD), self.config)

    def get_allowed_characters(self) -> str:
        return self.node.chars

    def can_end(self) -> bool:
        return self.node.end

    def cache_key(self) -> Any:
        return id(self.node)  # the trie lives as long as the factory and its cache
