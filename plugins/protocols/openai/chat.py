"""POST /v1/chat/completions: chat template rendering, n, logprobs, streaming deltas, usage."""

from __future__ import annotations

import uuid
from typing import Any, AsyncIterator

from starlette.responses import JSONResponse

from llmserve import InvalidRequestError
from llmserve import ChainMaker, ParseChain
from llmserve import first_call_only
from llmserve import ToolPlan
from llmserve import ChatTurn, effort_budget, prepare_chat
from llmserve import SSE_DONE, STREAM_HEADERS, sse
from llmserve import to_error
from llmserve import arguments_as_object, content_text, message_content
from llmserve import chat_logprobs

from .deltas import REASONING_KEYS, openai_delta
from .params import chat_policy, chat_sampling, guided_spec, now, truncate, truncation
from .replies import SYSTEM_FINGERPRINT, Endpoint, prompt_logprobs, usage_dict
from .wire import ChatCompletionRequest


class Chat(Endpoint):

    def count_tokens(self, text: str | None) -> int:
        """Tokens of ``text``: the reasoning parser's share of the output, re-tokenized (it is
        cut out of the text, so its token ids are not at hand), for ``reasoning_tokens``."""
        if not text:
            return 0
        return len(self.p.context.engine.tokenizer.encode(text, add_special_tokens=False))

    def turn(self, body: ChatCompletionRequest, sampling: Any, request_id: str) -> ChatTurn:
        """The request in the core's terms (``prepare_chat`` plans, renders and tokenizes it)."""
        ctx = self.p.context
        if body.chat_template is not None and not ctx.config.parsing.trust_request_chat_template:
            raise InvalidRequestError("chat_template in requests is disabled on this server "
                                      "(start it with --trust-request-chat-template)", param="chat_template")
        keep = truncation(body, ctx.engine.max_model_len)
        continued = bool(body.continue_final_message)
        turn = ChatTurn(sampling=sampling, request_id=request_id, tools=body.tools, tool_choice=body.tool_choice,
                        parallel_tool_calls=body.parallel_tool_calls, constraint=guided_spec(body),
                        forced_words="tool_choice required or a named function",
                        template_kwargs=body.chat_template_kwargs,
                        add_generation_prompt=body.add_generation_prompt is not False and not continued,
                        continue_final_message=continued, chat_template=body.chat_template,
                        documents=body.documents, priority=5 if body.priority is None else body.priority,
                        truncate=None if keep is None else lambda ids: truncate(ids, keep, body.truncation_side))
        if body.prompt_token_ids:
            turn.prompt_ids = list(body.prompt_token_ids)
            return turn
        messages = []
        cap = ctx.config.media.max_image_bytes
        for i, m in enumerate(body.messages):
            msg = m.model_dump(exclude_none=True)
            msg["content"] = message_content(m.content, i, turn.images, cap) or ""
            for call in msg.get("tool_calls") or []:
                arguments_as_object(call)
            messages.append(msg)
        if body.disable_chat_template:
            turn.text = "\n".join(content_text(m["content"]) for m in messages)
        else:
            turn.messages = messages
        return turn

    async def __call__(self, body: ChatCompletionRequest, request_id: str | None) -> Any:
        ctx = self.p.context
        model = ctx.check_model(body.model)
        policy = chat_policy(body)
        sampling = chat_sampling(body, ctx.engine.info.vocab_size, ctx.engine.limits.max_logprobs, policy.names)
        if body.stream and sampling.num_sequences > sampling.n:
            raise InvalidRequestError("best_of > n is not supported when streaming", param="best_of")
        turn = self.turn(body, sampling, body.request_id or request_id or uuid.uuid4().hex)
        turn.policy = policy
        # A thinking budget: the thinking_budget extra, else reasoning_effort through the server's table.
        turn.reasoning_budget = body.thinking_budget
        if turn.reasoning_budget is None and body.reasoning_effort is not None:
            turn.reasoning_budget = effort_budget(ctx, body.reasoning_effort, "reasoning_effort")
        prepared = await prepare_chat(ctx, turn)
        req, plan, make_chain = prepared.request, prepared.plan, prepared.chains.make
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
        engine_counted: int | None = None  # reasoning tokens the engine counted (a thinking budget)
        async for _, event in self.p.context.engine.generate_many([req]):
            engine_counted = event.usage.reasoning_tokens
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
        if engine_counted is not None:
            reasoning_tokens = engine_counted
        return {**head, "choices": choices, "usage": _with_reasoning(usage_dict(*usage), reasoning_tokens),
                "prompt_logprobs": prompt_logprobs(prompt_lps, self.tt, req.sampling.prompt_logprobs or 0),
                "prompt_token_ids": req.prompt_token_ids if body.return_token_ids else None}

    async def _stream(self, body: ChatCompletionRequest, req: Any, head: dict,
                      make_chain: ChainMaker | None, plan: ToolPlan) -> AsyncIterator[str]:
        opts = body.stream_options
        include_usage = bool(opts and opts.include_usage) or self.p.context.config.parsing.enable_force_include_usage
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

        engine_counted: int | None = None  # reasoning tokens the engine counted (a thinking budget)
        try:
            async for _, event in self.p.context.engine.generate_many([req]):
                usage = (event.usage.prompt_tokens, event.usage.completion_tokens, event.usage.cached_tokens)
                engine_counted = event.usage.reasoning_tokens
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
                spent = engine_counted if engine_counted is not None else spent
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
