"""Thinking budgets, enforced per sequence: the reasoning tokens are counted as they are
generated, and once a request's budget (``ReasoningBudget``) is spent the engine forces the
reasoning parser's end marker, token by token, after which the model writes its answer.

A ``BudgetTracker`` exists only for sequences whose request carries a budget: a request
without one costs the decode step nothing here. Forcing goes through the backend's one
restriction hook, the ``LogitsMask`` (the tracker is its own mask while it forces, allowing
exactly the next forced token), so every backend that honours guided decoding honours budgets.
"""

from __future__ import annotations

from llmserve.request import ReasoningBudget

WAIT, THINK, FORCE, DONE = range(4)
MAX_LEAD = 4096  # characters of leading output searched for the start marker


class BudgetTracker:
    """One sequence's reasoning budget: where its reasoning stands and what is still to force.

    ``count`` is the reasoning tokens so far (the tokens between the markers, a forced note
    included, the markers excluded): what usage reports as reasoning tokens. The engine calls
    ``on_token`` with each generated token and the text it added, and uses the tracker as the
    sequence's mask while ``forcing``.
    """

    __slots__ = ("budget", "phase", "count", "text", "recent", "pending", "queue", "pos", "notes")

    def __init__(self, budget: ReasoningBudget) -> None:
        self.budget = budget
        self.phase = WAIT
        self.count = 0
        self.text = ""  # WAIT: the output so far
        self.recent: list[str] = []  # THINK: the texts of the last tokens, enough to hold the end marker
        self.pending = 0  # WAIT: tokens seen before the reasoning is known to have started
        self.queue: tuple[int, ...] = ()  # FORCE: the note's ids, then the end marker's
        self.pos = 0
        self.notes = 0  # how many of ``queue``'s first ids are the note (counted as reasoning)
        if budget.opened or not budget.start:
            self._think()

    @property
    def forcing(self) -> bool:
        return self.phase == FORCE

    def allowed(self, output_token_ids: list[int]) -> list[int] | None:
        """The ``LogitsMask`` hook while forcing: only the next forced token."""
        return [self.queue[self.pos]] if self.phase == FORCE else None

    def on_token(self, token: int, text: str) -> None:
        """Account for one generated ``token`` that added ``text`` to the output."""
        phase = self.phase
        if phase == THINK:
            self.count += 1
            self._think_text(text)
        elif phase == FORCE:
            if token != self.queue[self.pos]:  # something overrode the mask: stop steering
                self.phase = DONE
                return
            if self.pos < self.notes:
                self.count += 1
            self.pos += 1
            if self.pos == len(self.queue):
                self.phase = DONE
        elif phase == WAIT:
            self._wait(text)

    def _wait(self, text: str) -> None:
        """Before the reasoning: it opens only where the output starts (after whitespace) with
        the start marker; any other first words are an answer without thinking."""
        start = self.budget.start or ""
        self.pending += 1
        self.text += text
        lead = self.text.lstrip()
        if start and lead.startswith(start):
            self._think()  # the marker's tokens are not reasoning
        elif (lead and not start.startswith(lead)) or len(self.text) > MAX_LEAD:
            if self.budget.default_open:  # the parser reads unmarked output as reasoning: it was
                lead, self.text = self.text, ""
                self._think(self.pending)
                self._think_text(lead)
            else:
                self.phase, self.text = DONE, ""

    def _think(self, count: int = 0) -> None:
        self.phase, self.text, self.count = THINK, "", count
        self._check_spent()

    def _think_text(self, text: str) -> None:
        """Look for the end marker in the reasoning's newest text; the tokens that hold only the
        marker are not reasoning."""
        end = self.budget.end
        recent = self.recent
        recent.append(text)
        tail = "".join(recent)
        at = tail.find(end)
        if at >= 0:  # the model closed its reasoning itself
            offset = 0
            for piece in recent:
                if offset >= at:
                    self.count -= 1
                offset += len(piece)
            self.phase, self.recent = DONE, []
            return
        while len(recent) > 1 and len(tail) - len(recent[0]) >= len(end) - 1:
            tail = tail[len(recent.pop(0)):]
        if self.phase == THINK:
            self._check_spent()

    def _check_spent(self) -> None:
        """Start forcing when the tokens left in the budget only hold the note: the note (when
        it fits) and the end marker follow, so the reasoning never passes the budget."""
        budget = self.budget
        note = budget.message_ids if len(budget.message_ids) <= budget.tokens else ()
        if budget.tokens - self.count > len(note):
            return
        self.queue, self.pos, self.notes = (*note, *budget.end_ids), 0, len(note)
        self.phase = FORCE if self.queue else DONE
