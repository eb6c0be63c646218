"""``POST /v1/messages`` (streamed and not) and ``POST /v1/messages/count_tokens``.

The request is translated into a ``ChatTurn`` and prepared by the core (``prepare_chat``).
One path for both reply kinds: the engine's text goes through the turn's parse chain (the
server's reasoning parser, its tool parser under ``auto``, the forced-call parser under
``any`` / ``tool``), and the chain's deltas are folded into content blocks by
``events.Blocks``: event by event when streaming, all at once otherwise.
"""

from __future__ import annotations

import uuid
from typing import Any, AsyncIterator

from starlette.responses import JSONResponse, Response

from llmserve import Usage
from llmserve import ChainMaker
from llmserve import ParseDelta
from llmserve import first_call_only
from llmserve import ToolPlan
from llmserve import PreparedRequest
from llmserve import ChatTurn, count_chat_tokens, prepare_chat
from llmserve import ImagePart
from llmserve import STREAM_HEADERS, in_band_errors, sse

from . import params
from .events import PING_EVENT, Blocks, event
from .wire import CountTokensRequest, MessagesRequest


def _usage(usage: Usage) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` excludes the prompt tokens read from the prefix cache,
    which are ``cache_read_input_tokens`` (the three input counts add up to the prompt)."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": usage.cached_tokens}


class Messages:
    """The Messages routes of one ``AnthropicProtocol``."""

    def __init__(self, protocol: Any) -> None:
        self.p = protocol

    # -- prompt -----------------------------------------------------------------------------
    def turn(self, body: CountTokensRequest, **fields: Any) -> ChatTurn:
        """The request in the core's terms (``prepare_chat`` plans, renders and tokenizes it)."""
        prefill = params.is_prefill(body)
        images: list[ImagePart] = []
        messages = params.chat_messages(body, drop_billing=self.p.opts.billing_header == "drop", images=images,
                                        max_image_bytes=self.p.context.config.media.max_image_bytes)
        return ChatTurn(messages=messages, add_generation_prompt=not prefill, images=images,
                        continue_final_message=prefill, template_kwargs=params.template_kwargs(body), **fields)

    async def count_tokens(self, body: CountTokensRequest) -> Response:
        ctx = self.p.context
        ctx.check_model(body.model)
        params.output_spec(body)  # the same 400s as a create request
        tokens = await count_chat_tokens(ctx, self.turn(body), params.offered_tools(body))
        return JSONResponse({"input_tokens": tokens})

    # -- create -----------------------------------------------------------------------------
    async def create(self, body: MessagesRequest) -> Response:
        ctx = self.p.context
        model = ctx.check_model(body.model)
        sampling = params.sampling(body)
        tools, choice, parallel = params.tool_fields(body, ctx.parsing.auto_tools, ctx.parsing.why_no_auto)
        turn = self.turn(body, sampling=sampling, request_id=uuid.uuid4().hex, tools=tools, tool_choice=choice,
                         parallel_tool_calls=parallel, constraint=params.output_spec(body),
                         forced_words="a forced tool_choice (any or tool)", policy=params.POLICY,
                         reasoning_budget=params.thinking_budget(ctx, body))
        prepared = await prepare_chat(ctx, turn)
        req = prepared.request
        head = {"id": f"msg_{req.request_id}", "type": "message", "role": "assistant", "model": model}
        reply = Reply(body, prepared.plan, prepared.chains.make, req.capped)
        if body.stream:
            frames = in_band_errors(self.p, self._stream(req, head, reply), lambda err: sse(err, "error"))
            return ctx.sse_response(frames, headers=STREAM_HEADERS, ping=PING_EVENT)
        return JSONResponse(await self._complete(req, head, reply))

    async def _complete(self, req: PreparedRequest, head: dict[str, Any], reply: "Reply") -> dict[str, Any]:
        texts: list[str] = []
        ids: list[int] = []
        usage = Usage()
        async for out in self.p.context.engine.generate(req):
            for d in out.outputs:
                texts.append(d.text)
                ids.extend(d.token_ids)
                reply.note_finish(d.finish_reason, d.stop_reason)
            usage = out.usage
        reply.add("".join(texts), ids, final=True)
        reply.blocks.close()
        stop, sequence = reply.stop()
        return {**head, "content": reply.blocks.content, "stop_reason": stop, "stop_sequence": sequence,
                "usage": _usage(usage)}

    async def _stream(self, req: PreparedRequest, head: dict[str, Any], reply: "Reply") -> AsyncIterator[str]:
        prompt_tokens = len(req.prompt_token_ids or [])
        # The prompt tokens the prefix cache holds now (Claude Code reads them here); the final
        # usage in message_delta says what was reused.
        cached = self.p.context.engine.cached_prefix(list(req.prompt_token_ids or []), req.media)
        start = {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": _usage(Usage(prompt_tokens=prompt_tokens, cached_tokens=cached))}
        yield event("message_start", message=start)
        yield PING_EVENT  # as Anthropic does: clients see the stream is alive before the first token
        usage = Usage(prompt_tokens=prompt_tokens)
        async for out in self.p.context.engine.generate(req):
            usage = out.usage
            for d in out.outputs:
                reply.note_finish(d.finish_reason, d.stop_reason)
                for frame in reply.add(d.text, d.token_ids, final=d.finish_reason is not None):
                    yield frame
        for frame in reply.add("", [], final=True) + reply.blocks.close():
            yield frame
        stop, sequence = reply.stop()
        yield event("message_delta", delta={"stop_reason": stop, "stop_sequence": sequence}, usage=_usage(usage))
        yield event("message_stop")


class Reply:
    """One reply's parse chain, content blocks and finish state."""

    def __init__(self, body: MessagesRequest, plan: ToolPlan, make_chain: ChainMaker | None,
                 capped: bool = False) -> None:
        self.body = body
        self.capped = capped  # max_tokens was cut to the room left in the context window
        self.parallel = plan.parallel
        self.chain = make_chain() if make_chain is not None else None
        self.blocks = Blocks(omit_thinking=body.thinking is not None and body.thinking.display == "omitted")
        self.finish: str | None = None
        self.stop_match: str | int | None = None
        self.done = False  # the chain has been finished

    def note_finish(self, finish: str | None, stop: str | int | None) -> None:
        if finish:
            self.finish, self.stop_match = finish, stop

    def add(self, text: str, ids: list[int], final: bool) -> list[str]:
        """Feed model output through the chain; return the events of what it released."""
        if self.chain is None or self.done:
            delta = ParseDelta(content=text if self.chain is None else "")
        else:
            delta = self.chain.feed(text, ids)
            if final:
                delta.extend(self.chain.finish())
                self.done = True
            if not self.parallel:
                delta = first_call_only(delta)
        return self.blocks.add(delta)

    def stop(self) -> tuple[str, str | None]:
        called = self.chain is not None and self.chain.tools_called
        reason = params.stop_reason(self.finish, self.stop_match, called, self.body.stop_sequences)
        if reason[0] == "max_tokens" and self.capped:
            return "model_context_window_exceeded", None
        return reason
