"""POST /v1/responses: items -> chat template -> engine -> output items, whole or streamed.

The request is translated into a ``ChatTurn`` (items -> chat messages, tools and
``tool_choice`` in the chat shapes, ``GuidedSpec`` for ``text.format``) that the core prepares
(``prepare_chat``: tool plan, forced calls, parse chains, template, tokens); ``OutputBuilder``
turns the parsed output into items and events. A stored previous response's conversation
goes before this request's input.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from llmserve import InvalidRequestError, NotFoundError
from llmserve import GuidedSpec
from llmserve import ChainMaker
from llmserve import ParseDelta
from llmserve import first_call_only
from llmserve import ToolPlan
from llmserve import PreparedRequest, RequestPolicy
from llmserve import SamplingParams
from llmserve import ChatTurn, effort_budget, prepare_chat
from llmserve import STREAM_HEADERS
from llmserve import to_error
from llmserve import TokenText, chat_logprobs

from .background import frames
from .items import Conversation, Namespaces, chat_tool_choice, chat_tools
from .output import OutputBuilder, new_id, usage
from .wire import ResponsesRequest

# Fields of other dialects that constrain output: refused, never ignored (a constraint must
# not fail open); the Responses spelling is text.format.
FOREIGN_CONSTRAINTS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                       "guided_grammar")
# Errors name the prompt ``input`` and the output cap as this API spells it; an output longer
# than the room is cut to it, as with chat completions (refused under --strict-max-tokens).
POLICY = RequestPolicy(prompt="input", names={"max_tokens": "max_output_tokens", "logprobs": "top_logprobs"},
                       length="fit")
LOGPROBS = "message.output_text.logprobs"  # the ``include`` value that asks for the answer's logprobs


def refuse_unsupported(body: ResponsesRequest) -> None:
    for name in FOREIGN_CONSTRAINTS:
        if getattr(body, name) is not None:
            raise InvalidRequestError(f"{name} is not a Responses API parameter; constrain the output with "
                                      "text.format", param=name)
    if body.conversation is not None:
        raise InvalidRequestError("conversation is not supported by this server; send the item history in "
                                  "input, or use previous_response_id", param="conversation")
    if body.prompt is not None:
        raise InvalidRequestError("prompt (stored prompt templates) is not supported by this server", param="prompt")


def text_format_spec(body: ResponsesRequest) -> GuidedSpec | None:
    """``text.format`` as a guided-decoding constraint (None for plain text)."""
    fmt = body.text.format if body.text is not None else None
    kind = fmt.get("type") if fmt is not None else "text"
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedSpec("json_object", None, param="text.format")
    if kind == "json_schema":
        assert fmt is not None
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequestError("text.format.schema: a JSON schema object is required when type is "
                                      "json_schema", param="text.format.schema")
        return GuidedSpec("json_schema", schema, param="text.format.schema")
    raise InvalidRequestError(f"text.format.type: must be text, json_object or json_schema; got {str(kind)[:40]!r}",
                              param="text.format.type")


@dataclass
class Prepared:
    """A validated request, ready to run."""

    body: ResponsesRequest
    model: str
    owner: str
    history: list[dict[str, Any]]
    input_items: list[dict[str, Any]]
    plan: ToolPlan
    make_chain: ChainMaker | None
    request: PreparedRequest
    namespaces: Namespaces = field(default_factory=dict)  # namespace tools' flat names
    labels: TokenText | None = None  # set when the answer's logprobs were asked for
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = field(default_factory=lambda: new_id("resp"))


class Create:
    """The ``POST /v1/responses`` handler."""

    def __init__(self, protocol: Any) -> None:
        self.p = protocol

    async def __call__(self, body: ResponsesRequest, request: Request) -> Response:
        prepared = await self.prepare(body, request)
        if body.background:  # answered now, run on: polled, streamed again or cancelled by id
            queued = self.p.background.start(prepared)
            if body.stream:
                events = self.p.background.runs[prepared.id].follow(-1)
                return self.p.context.sse_response(frames(events), headers=STREAM_HEADERS)
            return JSONResponse(queued)
        if body.stream:
            return self.p.context.sse_response(self._stream(prepared), headers=STREAM_HEADERS)
        builder, result = OutputBuilder(prepared.namespaces), {}
        async for _ in self._run(prepared, builder, result):
            pass  # the events of a stream; the reply is the items they built
        return JSONResponse(self._finish(prepared, builder, result))

    # -- translating the request ---------------------------------------------------------------
    async def prepare(self, body: ResponsesRequest, request: Request) -> Prepared:
        ctx = self.p.context
        refuse_unsupported(body)
        model = ctx.check_model(body.model)
        owner = self.p.owner(request)
        history = self._history(body, owner)
        if body.input is None and not history:
            raise InvalidRequestError("input: required (a string or a list of items)", param="input")
        items = ([{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str)
                 else list(body.input or []))
        conv = Conversation(ctx.config.media.max_image_bytes)
        if body.instructions:
            conv.messages.append({"role": "system", "content": body.instructions})
        conv.add_items(history, param="previous_response_id")
        conv.add_items(items)
        if not conv.messages:
            raise InvalidRequestError("input: must hold at least one item", param="input")
        tools, namespaces = chat_tools(body.tools)
        choice, offered = chat_tool_choice(body.tool_choice, tools)
        want_logprobs = LOGPROBS in (body.include or []) or body.top_logprobs is not None
        sampling = SamplingParams.build(POLICY.names, temperature=body.temperature, top_p=body.top_p,
                                        max_tokens=body.max_output_tokens,
                                        logprobs=(body.top_logprobs or 0) if want_logprobs else None)
        effort = body.reasoning.effort if body.reasoning is not None else None
        budget = effort_budget(ctx, effort, "reasoning.effort") if effort is not None else None
        turn = ChatTurn(sampling=sampling, request_id=request.headers.get("x-request-id") or new_id("req"),
                        messages=conv.messages, tools=offered, tool_choice=choice,
                        parallel_tool_calls=body.parallel_tool_calls, constraint=text_format_spec(body),
                        forced_words="tool_choice required or a named function",
                        template_kwargs={"reasoning_effort": effort} if effort else None, reasoning_budget=budget,
                        policy=POLICY, images=conv.images)
        prepared = await prepare_chat(ctx, turn)
        return Prepared(body, model, owner, history, items, prepared.plan, prepared.chains.make, prepared.request,
                        namespaces, TokenText(ctx.engine.tokenizer) if want_logprobs else None)

    def _history(self, body: ResponsesRequest, owner: str) -> list[dict[str, Any]]:
        if body.previous_response_id is None:
            return []
        store = self.p.store
        entry = store.get(owner, body.previous_response_id) if store is not None else None
        if entry is None:
            why = "" if store is not None else " (this server keeps no responses: its response store is off)"
            raise NotFoundError(f"Previous response with id '{body.previous_response_id[:100]}' not found.{why}",
                                param="previous_response_id")
        return entry.conversation

    # -- running -------------------------------------------------------------------------------
    async def _run(self, prep: Prepared, builder: OutputBuilder, result: dict[str, Any]) -> AsyncIterator[list]:
        """Generate, feeding ``builder``; yields the events of each step, and leaves the finish
        reason and token counts in ``result``."""
        chain = prep.make_chain() if prep.make_chain is not None else None
        finish, counts = None, (len(prep.request.prompt_token_ids or ()), 0, 0)
        counted: int | None = None  # the engine's count of reasoning tokens (a thinking budget)
        async for _, event in self.p.context.engine.generate_many([prep.request]):
            counts = (event.usage.prompt_tokens, event.usage.completion_tokens, event.usage.cached_tokens)
            counted = event.usage.reasoning_tokens
            for d in event.outputs:
                logprobs = chat_logprobs(d.logprobs, prep.labels) if prep.labels is not None and d.logprobs else None
                if chain is None:
                    builder.add(ParseDelta(content=d.text), logprobs)
                else:
                    parsed = chain.feed(d.text, d.token_ids)
                    if d.finish_reason:
                        parsed.extend(chain.finish())
                    builder.add(parsed if prep.plan.parallel else first_call_only(parsed), logprobs)
                finish = d.finish_reason or finish
            events = builder.take()
            if events:
                yield events
        builder.finish(incomplete=finish == "length")
        result.update(finish=finish, counts=counts, reasoning_tokens=counted)
        yield builder.take()

    def _finish(self, prep: Prepared, builder: OutputBuilder, result: dict[str, Any]) -> dict[str, Any]:
        """The final response object (stored when asked to)."""
        prompt, completion, cached = result["counts"]
        reasoning = builder.text("reasoning")
        reasoning_tokens = result.get("reasoning_tokens")
        if reasoning_tokens is None:  # no thinking budget: the reasoning text, re-tokenized
            engine = self.p.context.engine
            reasoning_tokens = len(engine.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        incomplete = result["finish"] == "length"
        response = self.snapshot(prep, "incomplete" if incomplete else "completed", builder.items)
        response["incomplete_details"] = {"reason": "max_output_tokens"} if incomplete else None
        response["usage"] = usage(prompt, completion, cached, min(reasoning_tokens, completion))
        response["completed_at"] = None if incomplete else int(time.time())
        response["store"] = False
        store = self.p.store
        if store is not None and prep.body.store is not False:
            response["store"] = True
            conversation = [*prep.history, *prep.input_items, *builder.items]
            response["store"] = store.put(prep.owner, response, conversation)
        return response

    def snapshot(self, prep: Prepared, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        body = prep.body
        effort = body.reasoning.effort if body.reasoning is not None else None
        fmt = body.text.format if body.text is not None and body.text.format is not None else {"type": "text"}
        tools = body.tools or []
        return {
            "id": prep.id, "object": "response", "created_at": prep.created, "status": status, "error": None,
            "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "model": prep.model, "output": output,
            "parallel_tool_calls": prep.plan.parallel, "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": effort, "summary": None},
            "store": self.p.store is not None and body.store is not False,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": fmt}, "tool_choice": body.tool_choice or ("auto" if tools else "none"),
            "tools": tools, "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled",
            "usage": None, "user": body.user, "metadata": body.metadata or {}, "background": bool(body.background),
        }

    async def events(self, prep: Prepared) -> AsyncIterator[dict[str, Any]]:
        """The response's stream events, numbered (``sequence_number``), the final response stored
        by the last one; an error after the start is an ``error`` event."""
        seq = 0

        def numbered(event: dict[str, Any]) -> dict[str, Any]:
            nonlocal seq
            event["sequence_number"] = seq
            seq += 1
            return event

        builder, result = OutputBuilder(prep.namespaces), {}
        start = self.snapshot(prep, "queued" if prep.body.background else "in_progress", [])
        yield numbered({"type": "response.created", "response": start})
        yield numbered({"type": "response.in_progress", "response": {**start, "status": "in_progress"}})
        run = self._run(prep, builder, result)
        try:
            async for events in run:
                for event in events:
                    yield numbered(event)
            response = self._finish(prep, builder, result)
            kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
            yield numbered({"type": kind, "response": response})
        except Exception as exc:  # noqa: BLE001 - after the 200, errors travel in-band
            error = to_error(exc)
            yield numbered({"type": "error", "code": error.type, "message": error.message, "param": error.param})
        finally:
            await run.aclose()  # now, not at garbage collection: closing aborts the engine request

    def _stream(self, prep: Prepared) -> AsyncIterator[str]:
        return frames(self.events(prep))
