"""Documentation meta-tests: the docs must keep up with the code.

(a) every hookspec has a ``## <name>`` section in docs/hooks.md whose first code block shows
    ``def <name>(...)`` with the spec's parameter names;
(b) every hookspec is mentioned in some test module under tests/ (other than this one);
(c) every ``ServerConfig`` field's flag appears in docs/cli.md;
(d) every page docs/index.md links to exists.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from llmserve.hooks import specs as hookspecs
from llmserve.config import FIELDS, flag_name

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
THIS = Path(__file__).resolve()

HOOKS = sorted(name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
               if getattr(fn, "llmserve_spec", None) is not None)

# Hooks that no test exercises yet. Each is an expected failure (strict): when a test for one
# is added, its xfail turns into an XPASS failure, and the name must be removed from here.
UNTESTED_HOOKS: dict[str, str] = {}


def test_there_are_hookspecs():
    assert len(HOOKS) >= 7, HOOKS


def hook_sections(text: str) -> dict[str, str]:
    """``## heading`` -> the text up to the next ``## `` heading."""
    parts = re.split(r"^## +(.+?)\s*$", text, flags=re.M)
    return {parts[i].strip().strip("`"): parts[i + 1] for i in range(1, len(parts), 2)}


def signature_params(block: str, name: str) -> list[str] | None:
    """Parameter names of ``def name(...)`` in a code block (the body may be left out)."""
    match = re.search(rf"^\s*def {re.escape(name)}\(.*?\)(\s*->\s*[^\n:]+)?:?", block, flags=re.M | re.S)
    if match is None:
        return None
    source = match.group(0).strip()
    if not source.endswith(":"):
        source += ":"
    tree = ast.parse(source + " ...")
    fn = tree.body[0]
    assert isinstance(fn, ast.FunctionDef)
    args = fn.args
    return [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_documented_with_its_signature(hook):
    sections = hook_sections((DOCS / "hooks.md").read_text())
    assert hook in sections, f"docs/hooks.md has no '## {hook}' section"
    blocks = re.findall(r"```[a-z]*\n(.*?)```", sections[hook], flags=re.S)
    assert blocks, f"the '## {hook}' section of docs/hooks.md has no code block"
    documented = signature_params(blocks[0], hook)
    assert documented is not None, f"the first code block under '## {hook}' does not contain 'def {hook}('"
    expected = list(inspect.signature(getattr(hookspecs, hook)).parameters)
    assert documented == expected, \
        f"docs/hooks.md documents {hook}{tuple(documented)}, the spec is {hook}{tuple(expected)}"


def test_signature_parser_catches_wrong_parameters():
    assert signature_params("def startup(context: Any) -> None", "startup") == ["context"]
    assert signature_params("def startup(ctx) -> None", "startup") == ["ctx"]
    assert signature_params("def register_backends() -> list[BackendSpec]", "register_backends") == []
    assert signature_params("def other() -> None", "startup") is None


def _test_files():
    return [p for p in (ROOT / "tests").rglob("*.py") if p.resolve() != THIS]


@pytest.mark.parametrize("hook", [pytest.param(h, marks=pytest.mark.xfail(strict=True, reason=UNTESTED_HOOKS[h]))
                                  if h in UNTESTED_HOOKS else h for h in HOOKS])
def test_hook_has_a_test(hook):
    mentioned = [p for p in _test_files() if re.search(rf"\b{hook}\b", p.read_text())]
    assert mentioned, f"hook '{hook}' is not used by any file under tests/: it has no test"


def test_untested_list_names_real_hooks():
    assert set(UNTESTED_HOOKS) <= set(HOOKS)


@pytest.mark.parametrize("field", FIELDS)
def test_every_flag_in_cli_docs(field):
    text = (DOCS / "cli.md").read_text()
    flag = flag_name(field)
    assert re.search(rf"`{re.escape(flag)}`", text), f"docs/cli.md does not mention {flag}"


def test_index_links_exist():
    text = (DOCS / "index.md").read_text()
    links = [link.split("#")[0] for link in re.findall(r"\]\(([^)\s]+)\)", text)]
    local = [link for link in links if link and not re.match(r"[a-z]+://|mailto:", link)]
    assert local, "docs/index.md links to no page"
    missing = [link for link in local if not (DOCS / link).resolve().is_file()]
    assert not missing, f"docs/index.md links to missing pages: {missing}"


# ---- (e) no page says a built feature is planned or missing -----------------------------------

STALE_WORDS = re.compile(r"\b(planned|not yet|coming soon|in progress|not built|not implemented|"
                         r"at this stage|work in progress|TODO)\b", re.I)
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]

# Sentences with those words that are true today: (page, words of the sentence around the match).
# When the feature gets built, the sentence must change and its entry must go.
TRUE_STATEMENTS = {
    ("docs/scale-out.md", "admitted but not yet in the running batch"),
    ("docs/ollama.md", "so they are not implemented at all rather than restricted"),
    ("docs/vllm-native.md", "Beam search is not implemented"),
}


def stale_phrases() -> list[tuple[str, int, str, str]]:
    """(page, line, the words around the match, the match) for every stale-sounding phrase."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in STALE_WORDS.finditer(text):
            around = re.sub(r"\s+", " ", text[max(0, match.start() - 120):match.end() + 120])
            found.append((str(page.relative_to(ROOT)), text.count("\n", 0, match.start()) + 1, around,
                          match.group(0)))
    return found


def test_no_page_calls_a_feature_planned_or_missing():
    unexplained = [f"{page}:{line}: '{word}' in ...{around}..." for page, line, around, word in stale_phrases()
                   if not any(page == p and words in around for p, words in TRUE_STATEMENTS)]
    assert not unexplained, ("a page says something is planned, missing or in progress; if it is built, fix the "
                             "page; if the sentence is true, add it to TRUE_STATEMENTS:\n" + "\n".join(unexplained))


def test_every_true_statement_is_still_on_its_page():
    found = stale_phrases()
    gone = [(p, w) for p, w in TRUE_STATEMENTS if not any(page == p and w in around for page, _, around, _ in found)]
    assert not gone, f"remove these from TRUE_STATEMENTS, their pages no longer say them: {gone}"
