"""POST /v1/chat/completions: chat template rendering, n, logprobs, streaming deltas, usage."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, AsyncIterator

from starlette.responses import JSONResponse

from llmserve.errors import InvalidRequestError
from llmserve.guided import GuidedSpec
from llmserve.parsing.chain import ChainMaker, ParseChain
from llmserve.parsing.forced import first_call_only
from llmserve.parsing.tool_choice import ToolPlan, plan_tools
from llmserve.server.dialect_kit import SSE_DONE, STREAM_HEADERS, sse
from llmserve.server.errors import to_error
from llmserve.text.chat_template import arguments_as_object, message_text, render_chat

from .deltas import REASONING_KEYS, openai_delta
from .params import chat_sampling, guided_mask, guided_spec, new_request, now, truncate, truncation
from .replies import SYSTEM_FINGERPRINT, Endpoint, chat_logprobs, prompt_logprobs, usage_dict
from .wire import ChatCompletionRequest


class Chat(Endpoint):

    def plan(self, body: ChatCompletionRequest) -> ToolPlan:
        cfg = self.p.context.config
        return plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls,
                          auto_enabled=cfg.enable_auto_tool_choice, tool_parser=cfg.tool_call_parser)

    def count_tokens(self, text: str | None) -> int:
        """Tokens of ``text``: the reasoning parser's share of the output, re-tokenized (it is
        cut out of the text, so its token ids are not at hand), for ``reasoning_tokens``."""
        if not text:
            return 0
        return len(self.p.context.engine.tokenizer.encode(text, add_special_tokens=False))

    def parsers(self, body: ChatCompletionRequest, plan: ToolPlan, constrained: bool) -> ChainMaker | None:
        """A maker of fresh parse chains (one per choice), or None when nothing is parsed."""
        ctx = self.p.context
        cfg = ctx.config
        return ParseChain.factory(ctx.registry, tool_parser=cfg.tool_call_parser,
                                  reasoning_parser=cfg.reasoning_parser, tokenizer=ctx.engine.tokenizer,
                                  chat_template_kwargs=body.chat_template_kwargs, plan=plan,
                                  constrained=constrained)

    def render(self, body: ChatCompletionRequest, plan: ToolPlan) -> tuple[str | None, list[int] | None]:
        if body.prompt_token_ids:
            return None, list(body.prompt_token_ids)
        if body.chat_template is not None and not self.p.context.config.trust_request_chat_template:
            raise InvalidRequestError("chat_template in requests is disabled on this server "
                                      "(start it with --trust-request-chat-template)", param="chat_template")
        messages = []
        for i, m in enumerate(body.messages):
            msg = m.model_dump(exclude_none=True)
            msg["content"] = message_text(m.content, i) or ""
            for call in msg.get("tool_calls") or []:
                arguments_as_object(call)
            messages.append(msg)
        if body.disable_chat_template:
            return "\n".join(m["content"] for m in messages), None
        text = render_chat(self.p.context.engine.tokenizer, messages, tools=plan.offered,
                           add_generation_prompt=(body.add_generation_prompt is not False
                                                  and not body.continue_final_message),
                           continue_final_message=bool(body.continue_final_message),
                           chat_template=body.chat_template, template_kwargs=body.chat_template_kwargs,
                           documents=body.documents, trusted=self.p.context.config.trust_request_chat_template,
                           timeout=self.p.context.config.chat_template_render_timeout)
        return text, None

    async def __call__(self, body: ChatCompletionRequest, request_id: str | None) -> Any:
        ctx = self.p.context
        model = ctx.check_model(body.model)
        plan = self.plan(body)
        if plan.schema is not None:
            if guided_spec(body) is not None:
                raise InvalidRequestError("tool_choice required or a named function cannot be combined with "
                                          "guided decoding or a JSON response_format", param="tool_choice")
            mask_factory = await ctx.guided.compile_async(GuidedSpec("json_schema", plan.schema, param="tool_choice",
                                                                     compact=True))
        else:
            mask_factory = await guided_mask(ctx, body)
        make_chain = self.parsers(body, plan, constrained=mask_factory is not None)
        sampling = chat_sampling(body, ctx.engine.info.vocab_size, ctx.engine.limits.max_logprobs)
        keep = truncation(body, ctx.engine.max_model_len)
        if make_chain is not None and make_chain().needs_special_tokens:
            sampling.skip_special_tokens = False  # the markers a parser looks for must reach it
        if body.stream and sampling.num_sequences > sampling.n:
            raise InvalidRequestError("best_of > n is not supported when streaming", param="best_of")
        # In a worker thread: rendering is capped (--chat-template-render-timeout), but even a
        # capped template must not stall other requests on the event loop meanwhile.
        prompt, prompt_ids = await asyncio.to_thread(self.render, body, plan)
        if keep is not None:
            if prompt_ids is None:
                prompt_ids = await ctx.engine.aencode(prompt or "", False, param="messages")
            prompt, prompt_ids = None, truncate(prompt_ids, keep, body.truncation_side)
        req = new_request(body, sampling, prompt=prompt, prompt_ids=prompt_ids, header_id=request_id,
                          add_special_tokens=False, mask_factory=mask_factory)
        try:
            await ctx.engine.aprepare(req, param="messages")
        except InvalidRequestError as exc:
            if exc.param == "max_tokens" and body.max_completion_tokens is not None:
                exc.param = "max_completion_tokens"  # name the field the client sent
            raise
        rid = f"chatcmpl-{body.request_id or request_id or uuid.uuid4().hex}"
        head = {"id": rid, "object": "chat.completion", "created": now(), "model": model,
                "system_fingerprint": SYSTEM_FINGERPRINT}
        if body.stream:
            head["object"] = "chat.completion.chunk"
            return ctx.sse_response(self._stream(body, req, head, make_chain, plan), headers=STREAM_HEADERS)
        return JSONResponse(await self._complete(body, req, head, make_chain, plan))

    async def _complete(self, body: ChatCompletionRequest, req: Any, head: dict,
                        make_chain: ChainMaker | None, plan: ToolPlan) -> dict:
        n = req.sampling.n
        acc: dict[int, dict] = {}
        usage = (0, 0, 0)
        prompt_lps = None
        async for _, event in self.p.context.engine.generate_many([req]):
            prompt_lps = event.prompt_logprobs if event.prompt_logprobs is not None else prompt_lps
            for d in event.outputs:
                if d.index >= n:
                    continue
                c = acc.setdefault(d.index, {"text": "", "ids": [], "lps": [], "finish": None, "stop": None})
                c["text"] += d.text
                c["ids"] += d.token_ids
                c["lps"] += d.logprobs or []
                if d.finish_reason:
                    c["finish"], c["stop"] = d.finish_reason, d.stop_reason
            usage = (event.usage.prompt_tokens, event.usage.completion_tokens, event.usage.cached_tokens)
        choices = []
        labels = self.labels(body)
        reasoning_tokens = 0
        for index in sorted(acc):
            c = acc[index]
            last = body.messages[-1].content
            prefix = (last or "") if body.echo and isinstance(last, str) else ""
            chain = make_chain() if make_chain is not None else None
            message, called, reasoning = _message(chain, c["text"], c["ids"], prefix, plan.parallel,
                                                  cut=_cut_forced(plan, c["finish"]),
                                                  show_reasoning=body.include_reasoning is not False)
            reasoning_tokens += self.count_tokens(reasoning)
            choice = {"index": index, "message": message,
                      "logprobs": {"content": chat_logprobs(c["lps"], labels), "refusal": None}
                      if body.logprobs else None,
                      "finish_reason": _finish(c["finish"], called), "stop_reason": c["stop"],
                      "token_ids": c["ids"] if body.return_token_ids else None}
            choices.append(choice)
        # vLLM's extra keys are always there, null unless asked for.
        return {**head, "choices": choices, "usage": _with_reasoning(usage_dict(*usage), reasoning_tokens),
                "prompt_logprobs": prompt_logprobs(prompt_lps, self.tt, req.sampling.prompt_logprobs or 0),
                "prompt_token_ids": req.prompt_token_ids if body.return_token_ids else None}

    async def _stream(self, body: ChatCompletionRequest, req: Any, head: dict,
                      make_chain: ChainMaker | None, plan: ToolPlan) -> AsyncIterator[str]:
        opts = body.stream_options
        include_usage = bool(opts and opts.include_usage) or self.p.context.config.enable_force_include_usage
        continuous = bool(opts and opts.continuous_usage_stats)
        usage = (len(req.prompt_token_ids), 0, 0)
        chains: dict[int, ParseChain | None] = {}
        reasoning: dict[int, str] = {}  # per choice, counted into usage at the end
        labels = self.labels(body)

        def chunk(choice: dict, **top: Any) -> str:
            out = {**head, **top, "choices": [choice]}
            if include_usage:
                out["usage"] = usage_dict(*usage) if continuous else None
            return sse(out)

        try:
            async for _, event in self.p.context.engine.generate_many([req]):
                usage = (event.usage.prompt_tokens, event.usage.completion_tokens, event.usage.cached_tokens)
                for d in event.outputs:
                    if d.index not in chains:
                        chains[d.index] = make_chain() if make_chain is not None else None
                        first = {"role": "assistant", "content": ""}
                        if body.echo and isinstance(body.messages[-1].content, str):
                            first["content"] = body.messages[-1].content
                        # The stream's first chunk carries the prompt's ids (vLLM).
                        once = body.return_token_ids and len(chains) == 1
                        ids = {"prompt_token_ids": req.prompt_token_ids} if once else {}
                        # The role chunk precedes the choice's tokens: its running usage counts none.
                        counted, usage = usage, (usage[0], 0, usage[2])
                        yield chunk({"index": d.index, "delta": first, "logprobs": None, "finish_reason": None}, **ids)
                        usage = counted
                    chain = chains[d.index]
                    if chain is None:
                        delta: dict[str, Any] = {"content": d.text} if d.text or not d.finish_reason else {}
                        finish = d.finish_reason
                    else:
                        parsed = chain.feed(d.text, d.token_ids)
                        if d.finish_reason:
                            end = chain.finish()
                            if not _cut_forced(plan, d.finish_reason):  # no made-up closers for a cut call
                                parsed.extend(end)
                        reasoning[d.index] = reasoning.get(d.index, "") + parsed.reasoning
                        if body.include_reasoning is False:
                            parsed.reasoning = ""
                        delta = openai_delta(parsed if plan.parallel else first_call_only(parsed)) or {}
                        finish = _finish(d.finish_reason, chain.tools_called)
                        if not (delta or d.finish_reason or (body.logprobs and d.logprobs) or body.return_token_ids):
                            continue  # the parser holds the text back for now
                    choice = {"index": d.index, "delta": delta, "logprobs": None, "finish_reason": finish}
                    if d.finish_reason:
                        choice["stop_reason"] = d.stop_reason
                    if body.logprobs and d.logprobs:
                        choice["logprobs"] = {"content": chat_logprobs(d.logprobs, labels), "refusal": None}
                    if body.return_token_ids:
                        choice["token_ids"] = d.token_ids
                    yield chunk(choice)
            if include_usage:
                spent = sum(self.count_tokens(text) for text in reasoning.values())
                yield sse({**head, "choices": [], "usage": _with_reasoning(usage_dict(*usage), spent)})
        except Exception as exc:  # noqa: BLE001 - after the 200, errors travel in-band
            yield sse(self.p.error_body(to_error(exc))[1])
        yield SSE_DONE


def _finish(reason: str | None, called: bool) -> str | None:
    """``tool_calls`` when the model called tools, unless it was cut off (then ``length``)."""
    return "tool_calls" if called and reason not in (None, "length") else reason


def _cut_forced(plan: ToolPlan, reason: str | None) -> bool:
    """A forced call (``required`` or a named function) cut off by ``max_tokens``: OpenAI and vLLM
    answer ``finish_reason: "length"`` without ``tool_calls`` (the arguments would not parse)."""
    return plan.mode == "forced" and reason == "length"


def _with_reasoning(usage: dict[str, Any], reasoning_tokens: int) -> dict[str, Any]:
    """Chat usage with OpenAI's ``completion_tokens_details.reasoning_tokens``."""
    spent = min(reasoning_tokens, usage["completion_tokens"])  # re-tokenized text can come out longer
    return {**usage, "completion_tokens_details": {"reasoning_tokens": spent}}


def _message(chain: ParseChain | None, text: str, ids: list[int], prefix: str, parallel: bool, *,
             cut: bool = False, show_reasoning: bool = True) -> tuple[dict[str, Any], bool, str | None]:
    """The assistant message of one choice, whether it called tools, and its reasoning text
    (returned even when ``show_reasoning`` is false, for usage). ``cut``: drop the calls."""
    if chain is None:
        return {"role": "assistant", "content": prefix + text}, False, None
    chain.feed(text, ids)
    chain.finish()
    result = chain.result()
    calls = [] if cut else result["tool_calls"] if parallel else result["tool_calls"][:1]
    content = result["content"]
    if content is None and not calls and result["reasoning_content"] is None:
        content = ""
    message: dict[str, Any] = {"role": "assistant", "content": prefix + content if content is not None else
                               (prefix or None)}
    if chain.reasoning_parser is not None:
        for key in REASONING_KEYS:  # include_reasoning false: the keys stay, null
            message[key] = result["reasoning_content"] if show_reasoning else None
    if calls:
        message["tool_calls"] = calls
    return message, bool(calls), result["reasoning_content"]
