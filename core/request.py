"""The dialect-neutral generate request."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Protocol

from llmserve.media.inputs import MediaInput
from llmserve.sampling import SamplingParams


class LogitsMask(Protocol):
    """Restricts the next token of one sequence (guided decoding plugs in here).

    The engine creates one mask per sequence (``GenerateRequest.mask_factory()``), so masks
    may keep per-sequence state. Before each sampled token it calls ``allowed(output_ids)``
    with the tokens generated so far; ``None`` means "no restriction", otherwise only the
    returned token ids may be sampled.
    """

    def allowed(self, output_token_ids: list[int]) -> list[int] | None: ...


@dataclass(frozen=True, slots=True)
class ReasoningBudget:
    """A request's thinking budget as the engine enforces it (``llmserve.engine.budget``).

    ``tokens``: the most reasoning tokens the sequence may generate. Past it the engine forces
    ``message_ids`` (a short note, dropped when it would not fit in the budget; the note counts
    as reasoning) then ``end_ids`` (the reasoning parser's ``end_marker`` as the tokenizer
    encodes it), and the answer continues. The reasoning starts at the first generated token
    when ``opened`` (the rendered prompt ends with ``start`` text), else where the model writes
    ``start`` at the start of its output (``start`` None: at the first token), or, with
    ``default_open`` (the reasoning parser reads output without the start marker as reasoning,
    as ``deepseek_r1`` does), at the first token of an output that does not start with it; it
    ends early where the model writes ``end`` itself. Markers are found in the detokenized text, so a
    marker spelled in several tokens counts as well as a single-token one.
    """

    tokens: int
    end: str
    end_ids: tuple[int, ...]
    message_ids: tuple[int, ...] = ()
    start: str | None = None
    opened: bool = False
    default_open: bool = False


@dataclass(slots=True)
class GenerateRequest:
    """One generation request as the engine sees it.

    Give either ``prompt`` (text, tokenized by the engine) or ``prompt_token_ids``.
    ``priority``: 1 is highest, larger numbers wait longer. ``deadline`` is an absolute
    ``time.monotonic()`` (build it with ``deadline_after``) past which the engine client
    ends the request: finish reason "length" if it produced output, else
    ``RequestTimeoutError``; its blocks are freed.
    """

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    priority: int = 5
    deadline: float | None = None
    add_special_tokens: bool = True
    mask_factory: Any = None  # Callable[[], LogitsMask] | None
    reasoning_budget: ReasoningBudget | None = None
    media: tuple[MediaInput, ...] = ()  # the prompt's images, expanded (``llmserve.media.inputs``)


@dataclass(frozen=True, slots=True)
class RequestPolicy:
    """How a dialect wants its requests prepared; declared once per route, as a constant.

    ``prompt`` is the field that errors about the prompt name (``messages``, ``inputs``,
    ``text_input``...). ``names`` maps the core's sampling fields to the client's own
    (``{"max_tokens": "max_completion_tokens"}``): every error the core raises about a field
    names it as the client sent it, so no dialect rewrites a message.

    ``length`` is what happens to an output longer than the room the prompt leaves, computed
    once, after tokenizing: ``reject`` (vLLM's own API, TGI: a 400 naming ``max_tokens``),
    ``cap`` (Anthropic, Ollama, MindIE: an unset or larger ``max_tokens`` becomes the room;
    ``PreparedRequest.capped`` says a given one was cut) or ``fit`` (OpenAI's chat, completions
    and Responses: ``cap``, unless the server runs with ``--strict-max-tokens``, then
    ``reject``). ``context_limit`` is a dialect's own context length for the request (Ollama's
    ``num_ctx``), at most the server's, named ``limit_param`` in the error of a prompt it cannot
    hold.
    """

    prompt: str = "prompt"
    names: Mapping[str, str] = field(default_factory=dict)
    length: Literal["reject", "cap", "fit"] = "reject"
    context_limit: int | None = None
    limit_param: str | None = None

    def name(self, field: str) -> str:
        """The client's name for the core's request field ``field``."""
        return self.prompt if field == "prompt" else self.names.get(field, field)


REJECT = RequestPolicy()


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A request the engine client tokenized and validated (``EngineClient.prepare``): what
    ``generate`` takes. Frozen: nothing changes a request between its validation and its run.

    ``sampling.max_tokens`` is always set (the room the prompt leaves when the client gave
    none); ``capped`` says the ``cap`` policy cut a larger one to that room. ``reasoning_budget``:
    the thinking budget the engine enforces, if any. ``media``: the prompt's images, each where
    its expansion sits in ``prompt_token_ids``.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    priority: int = 5
    deadline: float | None = None
    mask_factory: Any = None  # Callable[[], LogitsMask] | None
    capped: bool = False
    reasoning_budget: ReasoningBudget | None = None
    media: tuple[MediaInput, ...] = ()


def deadline_after(seconds: float | None) -> float | None:
    """The ``deadline`` for a time budget of ``seconds`` from now (None: no deadline).

    Every deadline in the server is on this one clock: monotonic, so a wall-clock step
    (NTP, a suspended VM) neither fires nor postpones it.
    """
    return None if seconds is None else time.monotonic() + seconds
