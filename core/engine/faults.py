"""Fault injection for tests: make the engine fail on purpose, in one request or as a whole.

Read once when the engine starts, from the environment variable ``LLMSERVE_FAULT_INJECTION``
(deliberately not a ServerConfig flag: it exists for tests and chaos drills, never for
production). The value is a comma-separated list of rules:

- ``step:N``: the engine's N-th model step raises, which kills the engine loop (every
  in-flight request fails, ``/health`` answers 503 and the server process exits non-zero).
- ``add:TEXT``: queuing a request whose id contains ``TEXT`` (``LLMEngine.add_request``) raises,
  which kills the engine loop while that request is being admitted: it gets the engine's
  death as its answer like every other one. ``add:#N`` does it to the N-th request queued
  (for dialects that pick their own request ids).
- ``request:TEXT``: post-processing of any request whose id contains ``TEXT`` raises, which
  fails that request only (like a detokenizer or logits-mask error would).
- ``mask:TEXT``: the logits mask of any request whose id contains ``TEXT`` raises when the
  backend asks it for the allowed tokens (a guided-decoding plugin failing).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

ENV = "LLMSERVE_FAULT_INJECTION"


class InjectedFault(RuntimeError):
    """Raised where a rule of ``LLMSERVE_FAULT_INJECTION`` says so."""


@dataclass
class FaultInjector:
    """The parsed rules; every check is a cheap no-op when no rule is set."""

    step: int | None = None
    request: list[str] = field(default_factory=list)
    mask: list[str] = field(default_factory=list)
    add: list[str] = field(default_factory=list)
    added: int = 0  # requests queued so far (for ``add:#N``)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "FaultInjector":
        return cls.parse((os.environ if environ is None else environ).get(ENV, ""))

    @classmethod
    def parse(cls, text: str) -> "FaultInjector":
        out = cls()
        for rule in filter(None, (part.strip() for part in text.split(","))):
            kind, sep, arg = rule.partition(":")
            if not sep or not arg:
                raise ValueError(f"{ENV}: expected KIND:VALUE, got {rule!r}")
            if kind == "step":
                out.step = int(arg)
            elif kind in ("request", "mask", "add"):
                getattr(out, kind).append(arg)
            else:
                raise ValueError(f"{ENV}: unknown rule {kind!r} (use step, add, request or mask)")
        return out

    @property
    def active(self) -> bool:
        return self.step is not None or bool(self.request or self.mask or self.add)

    def check_step(self, step_number: int) -> None:
        if self.step is not None and step_number == self.step:
            raise InjectedFault(f"injected engine fault at step {step_number}")

    def check_add(self, request_id: str) -> None:
        if not self.add:
            return
        self.added += 1
        if any(text in request_id or text == f"#{self.added}" for text in self.add):
            raise InjectedFault(f"injected engine fault while adding request {request_id}")

    def check_request(self, request_id: str) -> None:
        if any(text in request_id for text in self.request):
            raise InjectedFault(f"injected fault in request {request_id}")

    def fails_mask(self, request_id: str) -> bool:
        return any(text in request_id for text in self.mask)


class FailingMask:
    """A logits mask that raises when asked (what ``mask:TEXT`` installs)."""

    def allowed(self, output_token_ids: list[int]) -> list[int] | None:
        raise InjectedFault("injected fault in a logits mask")
