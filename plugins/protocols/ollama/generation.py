"""``/api/chat`` and ``/api/generate``: one run for both, answering with one JSON object or an
NDJSON stream (``application/x-ndjson``, one object per line, the last with ``done: true``).

The request is translated into a ``ChatTurn`` and prepared by the core (``prepare_chat``).
Chat output goes through the turn's parse chain (the server's parsers): thinking
becomes ``message.thinking``, tool calls ``message.tool_calls`` with ``arguments`` as a JSON
object (Ollama's shape, not OpenAI's string). A streamed call is sent whole, once the output
is complete, in the object before the final one.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.responses import JSONResponse, Response, StreamingResponse

from llmserve import ChainMaker
from llmserve import PreparedRequest
from llmserve import ChatTurn, effort_budget, prepare_chat
from llmserve import ImagePart
from llmserve import STREAM_HEADERS, dumps, in_band_errors

from . import params
from .params import created_at, durations, guided_spec, invalid, resolve_model, think_mode
from .prompts import NO_TEMPLATE, generate_prompt, ollama_images, template_messages
from .wire import ChatRequest
from .wire import GenerateRequest as OllamaGenerate

NDJSON = "application/x-ndjson"


@dataclass
class Run:
    """One request, ready for the engine, and how to shape its reply."""

    kind: str                      # "chat" or "generate"
    model: str                     # the name the reply carries (the request's, as Ollama echoes it)
    stream: bool
    request: PreparedRequest
    make_chain: ChainMaker | None
    return_context: bool = False   # generate without raw: the final object carries `context`
    started: float = field(default_factory=time.time)


def _frame(obj: Any) -> str:
    return dumps(obj) + "\n"


def _call(call: dict[str, Any], index: int) -> dict[str, Any]:
    """An assembled call in Ollama's shape: ``arguments`` as an object."""
    fn = call["function"]
    try:
        arguments = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):  # Ollama's clients require an object
        arguments = {"value": fn["arguments"]} if arguments is None else {"value": arguments}
    return {"id": call["id"], "function": {"index": index, "name": fn["name"], "arguments": arguments}}


class Generation:
    """The chat and generate routes of one ``OllamaProtocol``."""

    def __init__(self, protocol: Any) -> None:
        self.p = protocol

    @property
    def ctx(self) -> Any:
        return self.p.context

    # -- building ------------------------------------------------------------------------------
    def _loaded(self, kind: str, model: str, keep_alive: Any) -> Response:
        """Ollama's answer to a request with nothing to generate: the model is loaded (or, with
        keep_alive 0, unloaded as this request ends; the server's default model stays loaded)."""
        reason = "unload" if keep_alive in (0, "0", 0.0) else "load"
        body: dict[str, Any] = {"model": model, "created_at": created_at(), "done": True, "done_reason": reason}
        if kind == "chat":
            body["message"] = {"role": "assistant", "content": ""}
        else:
            body["response"] = ""
        return JSONResponse(body)

    def _turn(self, body: Any, request_id: str | None, think: bool | None, prompt: str, **fields: Any) -> ChatTurn:
        """The request in the core's terms (``prepare_chat`` renders, tokenizes and prepares it):
        the output is capped to the room the prompt leaves in ``num_ctx``, as Ollama does."""
        policy = params.policy(body.options, prompt)
        return ChatTurn(sampling=params.sampling(body.options), request_id=f"ollama-{request_id or uuid.uuid4().hex}",
                        constraint=guided_spec(body.format), template_kwargs=params.template_kwargs(body.think),
                        reasoning=think is not False, policy=policy, **fields,
                        # a think level is a reasoning effort: its thinking budget is enforced
                        reasoning_budget=effort_budget(self.ctx, body.think, "think")
                        if isinstance(body.think, str) else None)

    def _start(self, body: Any, what: str) -> str:
        """Resolve the model name and check what no request may ask of this server."""
        resolve_model(self.ctx, body.model)
        self.ctx.keep_model_alive(params.keep_alive_seconds(body.keep_alive))
        model = body.model or self.ctx.model_name
        if self.ctx.model.task == "embed":
            raise invalid(f'"{model}" does not support {what}: it is an embedding model (use /api/embed)', "model")
        params.check_unsupported(body)
        return model

    async def chat(self, body: ChatRequest, request_id: str | None) -> Response:
        model = self._start(body, "chat")
        if not body.messages:
            return self._loaded("chat", model, body.keep_alive)
        parsing = self.ctx.parsing
        think = think_mode(body.think, parsing.reasoning_parser, model)
        if body.tools and not parsing.auto_tools:
            raise invalid(f'"{model}" does not support tools: start the server with --enable-auto-tool-choice and '
                          f'--tool-call-parser{parsing.why_no_auto}', "tools")
        images: list[ImagePart] = []
        messages, continue_last = template_messages(body.messages, images, self.ctx.config.media.max_image_bytes)
        turn = self._turn(body, request_id, think, "messages", messages=messages, tools=body.tools or None,
                          add_generation_prompt=not continue_last, continue_final_message=continue_last,
                          no_template=NO_TEMPLATE, images=images)
        prepared = await prepare_chat(self.ctx, turn)
        return await self._answer(Run("chat", model, body.stream is not False, prepared.request,
                                      prepared.chains.make))

    async def generate(self, body: OllamaGenerate, request_id: str | None) -> Response:
        model = self._start(body, "generate")
        images = ollama_images(body.images, "images", self.ctx.config.media.max_image_bytes) if body.images else []
        if body.suffix:
            raise invalid("suffix (fill-in-the-middle) is not supported by this server", "suffix")
        if not body.prompt and not body.context:
            return self._loaded("generate", model, body.keep_alive)
        think = think_mode(body.think, self.ctx.parsing.reasoning_parser, model)
        tokenizer, timeout = self.ctx.engine.tokenizer, self.ctx.config.parsing.chat_template_render_timeout

        def render() -> tuple[str, bool]:
            text, special = generate_prompt(tokenizer, body, params.template_kwargs(body.think), timeout)
            return text, special and not body.context  # a continuation: the history already starts the sequence

        turn = self._turn(body, request_id, think, "prompt", render=render, prefix_ids=list(body.context or []),
                          images=images)
        prepared = await prepare_chat(self.ctx, turn)
        return await self._answer(Run("generate", model, body.stream is not False, prepared.request,
                                      prepared.chains.make, return_context=not body.raw))

    # -- answering -----------------------------------------------------------------------------
    def _piece(self, run: Run, content: str, thinking: str = "", calls: list | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"model": run.model, "created_at": created_at()}
        if run.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            out["message"] = message
        else:
            out["response"] = content
            if thinking:
                out["thinking"] = thinking
        out["done"] = False
        return out

    def _final(self, run: Run, piece: dict[str, Any], reason: str | None, usage: Any, timings: Any,
               output_ids: list[int]) -> dict[str, Any]:
        piece.update(done=True, done_reason=reason or "stop")
        if run.return_context:
            eos = set(self.ctx.model.eos_token_ids)
            kept = output_ids[:-1] if output_ids and output_ids[-1] in eos else output_ids  # the next turn follows
            piece["context"] = list(run.request.prompt_token_ids or []) + kept
        piece.update(durations(run.started, timings))
        piece.update(prompt_eval_count=usage.prompt_tokens, eval_count=usage.completion_tokens)
        return piece

    async def _answer(self, run: Run) -> Response:
        if run.stream:
            source = self._stream(run)
            return StreamingResponse(in_band_errors(self.p, source, _frame), media_type=NDJSON,
                                     headers=STREAM_HEADERS)
        chain = run.make_chain() if run.make_chain is not None else None
        text, ids, reason, last = "", [], None, None
        async for event in self.ctx.engine.generate(run.request):
            for d in event.outputs:
                text += d.text
                ids += d.token_ids
                reason = d.finish_reason or reason
            last = event
        thinking, calls = "", None
        if chain is not None:
            result = chain.parse(text)
            text, thinking = result["content"] or "", result["reasoning_content"] or ""
            calls = [_call(c, i) for i, c in enumerate(result["tool_calls"])] or None
        piece = self._piece(run, text, thinking, calls)
        return JSONResponse(self._final(run, piece, reason, last.usage, last.timings, ids))

    async def _stream(self, run: Run) -> AsyncIterator[str]:
        chain = run.make_chain() if run.make_chain is not None else None
        ids: list[int] = []
        reason = None
        async for event in self.ctx.engine.generate(run.request):
            for d in event.outputs:
                ids += d.token_ids
                reason = d.finish_reason or reason
                if chain is None:
                    if d.text:
                        yield _frame(self._piece(run, d.text))
                    continue
                parsed = chain.feed(d.text, d.token_ids)
                if d.finish_reason:
                    parsed.extend(chain.finish())
                if parsed.content or parsed.reasoning:
                    yield _frame(self._piece(run, parsed.content, parsed.reasoning))
            if event.finished:
                calls = chain.result()["tool_calls"] if chain is not None else []
                if calls:
                    yield _frame(self._piece(run, "", calls=[_call(c, i) for i, c in enumerate(calls)]))
                final = self._final(run, self._piece(run, ""), reason, event.usage, event.timings, ids)
                yield _frame(final)

