"""One chat turn, prepared in one place: planning the tools, the forced-call rule, compiling the
output constraint, the parse chains, rendering the chat template and tokenizing (off the event
loop, in the engine client's tokenizer threads) and preparing the engine request.

A chat dialect translates its wire fields into a ``ChatTurn`` and awaits ``prepare_chat``;
it keeps its wire models, that translation, and the rendering of the reply from
``PreparedChat.chains`` (``docs/architecture.md``: one chat turn)::

    turn = ChatTurn(sampling=sampling, request_id=rid, messages=messages, tools=tools,
                    tool_choice=choice, constraint=spec, forced_words="tool_choice required")
    prepared = await prepare_chat(context, turn)
    async for event in context.engine.generate(prepared.request): ...
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from llmserve.errors import InvalidRequestError
from llmserve.guided import GuidedSpec
from llmserve.media.inputs import MediaInput, after_cut, reads_images
from llmserve.media.parts import ImagePart
from llmserve.parsing.service import Chains
from llmserve.parsing.tool_choice import ToolPlan
from llmserve.request import GenerateRequest, PreparedRequest, ReasoningBudget, RequestPolicy
from llmserve.sampling import SamplingParams
from llmserve.text.chat_template import render_chat

if TYPE_CHECKING:
    from llmserve.server.context import ServerContext

CHAT = RequestPolicy(prompt="messages")  # OpenAI's: reject an output longer than the room


@dataclass(slots=True)
class ChatTurn:
    """A chat request in the core's terms: what each dialect translates its fields into.

    The prompt is one of: ``prompt_ids`` (given token ids: nothing is rendered), ``render`` (a
    dialect's own prompt text and whether the tokenizer adds its special tokens, e.g. Ollama's
    ``/api/generate`` templates; run off the event loop), ``text`` (taken as it is), else
    ``messages`` rendered with the chat template. ``prefix_ids`` go before the tokenized text.

    ``tools`` / ``tool_choice`` /
    ``parallel_tool_calls`` are in OpenAI's shapes; ``forced_words`` names a forced call in the
    dialect's words when one meets ``constraint`` (a 400). ``reasoning``: false when the request
    turned thinking off; ``reasoning_budget`` is its thinking budget in tokens (the engine ends
    the reasoning there, under a reasoning parser that declares its ``end_marker``; none:
    unlimited). ``truncate`` cuts the prompt's ids (vLLM's ``truncate_prompt_tokens``).
    ``no_template``, when given, is the refusal for a model without a chat template.
    ``images`` are the request's images in order (``llmserve.media.parts.ImagePart``, each naming
    its field); the messages hold an ``{"type": "image"}`` part where each one was. ``deadline``
    (``llmserve.deadline_after``): when the engine gives up on the request (MindIE's ``timeout``).

    ``policy`` is the dialect's ``RequestPolicy``: the field prompt errors name (``messages``),
    its names for the sampling fields, and its length policy (``reject`` as OpenAI, ``cap`` as
    Anthropic and Ollama, with Ollama's ``num_ctx`` as its context limit). The ``sampling`` was
    built with the same names (``SamplingParams.build(names=policy.names, ...)``).
    """

    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    messages: list[dict[str, Any]] | None = None
    text: str | None = None
    prompt_ids: list[int] | None = None
    render: Callable[[], tuple[str, bool]] | None = None
    prefix_ids: list[int] = field(default_factory=list)
    add_special_tokens: bool = False
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    constraint: GuidedSpec | None = None
    forced_words: str = "a forced tool call"
    template_kwargs: dict[str, Any] | None = None
    reasoning: bool = True
    reasoning_budget: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    documents: list[dict[str, Any]] | None = None
    truncate: Callable[[list[int]], list[int]] | None = None
    policy: RequestPolicy = CHAT
    priority: int = 5
    deadline: float | None = None
    no_template: str | None = None
    images: list[ImagePart] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class PreparedChat:
    """A chat turn ready for the engine: its request (tokenized and validated), its tool plan
    and its parse chains (``chains.make()``: a fresh chain per choice; ``None`` when nothing
    is parsed)."""

    request: PreparedRequest  # ``request.capped``: the ``cap`` policy cut max_tokens to the room
    plan: ToolPlan
    chains: Chains


async def prepare_chat(context: "ServerContext", turn: ChatTurn) -> PreparedChat:
    """Plan, constrain, render, tokenize and prepare ``turn``; raises the core's errors (400s
    naming the field). Everything that grows with the prompt runs in a tokenizer thread."""
    engine = context.engine
    assert engine is not None, "the loading gate lets no chat request through before the model"
    images = await turn_images(context, turn)
    plan = context.parsing.plan(turn.tools, turn.tool_choice, turn.parallel_tool_calls)
    spec = turn.constraint
    if plan.schema is not None:
        if spec is not None:
            raise InvalidRequestError(f"{turn.forced_words} cannot be combined with {spec.param}",
                                      param="tool_choice")
        # In the tool parser's own syntax when it declares one, else JSON (linear in the tools).
        spec = await asyncio.to_thread(context.parsing.forced_spec, plan)
    mask_factory = await context.guided.compile_async(spec) if spec is not None else None
    chains = context.parsing.chains(engine.tokenizer, plan, constrained=mask_factory is not None,
                                    reasoning=turn.reasoning, template_kwargs=turn.template_kwargs,
                                    native=spec is not None and spec.kind == "structure" and plan.schema is not None)
    request = await engine.in_worker(_request, context, turn, plan, chains, mask_factory, images)
    return PreparedChat(request, plan, chains)


def effort_budget(context: "ServerContext", effort: str, param: str) -> int:
    """The thinking budget, in tokens, of a reasoning ``effort`` (``none`` ... ``xhigh``) in the
    server's table (``--reasoning-effort-budgets``); an effort the table lacks is a 400 naming
    ``param`` (each dialect renders it in its own format)."""
    table = context.config.parsing.reasoning_effort_budgets
    if effort not in table:
        known = ", ".join(repr(k) for k in table)
        raise InvalidRequestError(f"Invalid value: {str(effort)[:40]!r}. Supported values are: {known}.",
                                  param=param)
    return table[effort]


async def count_chat_tokens(context: "ServerContext", turn: ChatTurn, tools: list[dict[str, Any]] | None) -> int:
    """The prompt tokens of ``turn`` rendered with ``tools`` offered (a token-counting route:
    no plan, no server flags), counted off the event loop."""
    assert context.engine is not None
    images = await turn_images(context, turn)
    _, ids, _ = await context.engine.in_worker(_prompt, context, turn, tools, images)
    return len(ids)


async def turn_images(context: "ServerContext", turn: ChatTurn) -> list[Any]:
    """The turn's images, fetched and decoded (``request_images``)."""
    return await request_images(context, turn.images)


async def request_images(context: "ServerContext", parts: list[ImagePart], param: str | None = None) -> list[Any]:
    """A request's images, fetched under the server's rules and decoded (``llmserve.media``), or a
    400 naming ``param`` (default: the first image's field) when the served model takes text only."""
    if not parts:
        return []
    if not reads_images(context.engine.info if context.engine is not None else None):
        raise InvalidRequestError("images are not supported: the served model takes text only",
                                  param=param or parts[0].param)
    from llmserve.media.image import load_images

    return await load_images(parts, context.config.media)


def _prompt(context: "ServerContext", turn: ChatTurn, tools: list[dict[str, Any]] | None,
            images: list[Any]) -> tuple[str | None, list[int], tuple[MediaInput, ...]]:
    """The prompt's text (None when given as ids), token ids and images (each expanded into the
    model's placeholders by its ``ModelInfo.media``). In a tokenizer thread."""
    engine = context.engine
    assert engine is not None
    if turn.prompt_ids is not None:
        return None, list(turn.prompt_ids), ()
    special = turn.add_special_tokens
    if turn.render is not None:
        text, special = turn.render()
    elif turn.text is not None:
        text = turn.text
    else:
        if turn.no_template and not getattr(engine.tokenizer, "chat_template", None):
            raise InvalidRequestError(turn.no_template, param=turn.policy.prompt)
        cfg = context.config
        text = render_chat(engine.tokenizer, turn.messages or [], tools=tools,
                           add_generation_prompt=turn.add_generation_prompt,
                           continue_final_message=turn.continue_final_message, chat_template=turn.chat_template,
                           template_kwargs=turn.template_kwargs, documents=turn.documents,
                           trusted=cfg.parsing.trust_request_chat_template,
                           timeout=cfg.parsing.chat_template_render_timeout)
    if turn.truncate is None:  # the whole prompt must fit: one too long for any tokenization is refused now
        engine.limits.check_fits(text, turn.policy.prompt)
    ids = [*turn.prefix_ids, *(engine.encode(text, special, param=turn.policy.prompt) if text else [])]
    if not images:
        return text, ids, ()
    ids, media = engine.info.media.expand(ids, images, turn.images[0].param)
    return text, ids, media


def _request(context: "ServerContext", turn: ChatTurn, plan: ToolPlan, chains: Chains,
             mask_factory: Any, images: list[Any]) -> PreparedRequest:
    """The prepared engine request of ``turn``: tokenized, fitted to the room the prompt leaves
    under the dialect's policy and validated, once. In a tokenizer thread."""
    engine = context.engine
    assert engine is not None
    text, ids, media = _prompt(context, turn, plan.offered, images)
    if turn.truncate is not None:
        kept = turn.truncate(ids)
        media = after_cut(media, len(ids) - len(kept), "the prompt truncation would cut into an image: keep more "
                          "tokens or send fewer images", turn.images[0].param if turn.images else turn.policy.prompt)
        text, ids = None, kept
    request = GenerateRequest(prompt=text, prompt_token_ids=ids, sampling=chains.keep_markers(turn.sampling),
                              request_id=turn.request_id, priority=turn.priority, deadline=turn.deadline,
                              add_special_tokens=False,
                              mask_factory=mask_factory, media=media,
                              reasoning_budget=_budget(context, turn, chains, text, ids))
    return engine.prepare(request, turn.policy)


def _budget(context: "ServerContext", turn: ChatTurn, chains: Chains, text: str | None,
            ids: list[int]) -> ReasoningBudget | None:
    """The turn's thinking budget as the engine enforces it, or None: no budget asked for, no
    reasoning parser in the chains (thinking off, constrained output), or a parser that declares
    no ``end_marker``. Whether the prompt opened the reasoning is read from its text. In a
    tokenizer thread."""
    parser = chains.reasoning
    if turn.reasoning_budget is None or parser is None or not parser.end_marker:
        return None
    engine = context.engine
    assert engine is not None
    start = parser.start_marker or None
    if text is None:  # given as token ids: the tail is enough to see how the prompt ends
        text = engine.decode(ids[-64:], skip_special_tokens=False)
    if start is None:
        opened = True
    elif turn.continue_final_message:  # a continued message may hold an open reasoning anywhere
        opened = text.rfind(start) > text.rfind(parser.end_marker)
    else:
        opened = text.rstrip().endswith(start)
    # Whether the parser reads an output without the start marker as reasoning (deepseek_r1 does,
    # kimi_k2 does not): asked of a fresh parser, so a third-party parser is read the same way.
    probe = parser(None, turn.template_kwargs)
    default_open = bool(probe.feed("Probe.").extend(probe.finish()).reasoning)
    message = context.config.parsing.reasoning_budget_message
    return ReasoningBudget(
        tokens=turn.reasoning_budget, end=parser.end_marker,
        end_ids=tuple(engine.encode(parser.end_marker, False)),
        message_ids=tuple(engine.encode(message, False)) if message else (), start=start, opened=opened,
        default_open=default_open)
