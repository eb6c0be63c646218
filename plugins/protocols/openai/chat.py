"""POST /v1/chat/completions: chat template rendering, n, logprobs, streaming deltas, usage."""

from __future__ import annotations

import uuid
from typing import Any, AsyncIterator

from starlette.responses import JSONResponse, StreamingResponse

from llmserve.errors import InvalidRequestError
from llmserve.text.chat_template import message_text, render_chat

from .params import chat_sampling, guided_mask, new_request, now
from .streaming import SSE_HEADERS, TokenText, chat_logprobs, sse, sse_error, to_error, usage_dict
from .wire import ChatCompletionRequest


class Chat:
    def __init__(self, protocol: Any) -> None:
        self.p = protocol
        self._tt: TokenText | None = None

    @property
    def tt(self) -> TokenText:
        if self._tt is None:  # the model loads after routes are built
            self._tt = TokenText(self.p.context.engine.tokenizer)
        return self._tt

    def render(self, body: ChatCompletionRequest) -> tuple[str | None, list[int] | None]:
        if body.prompt_token_ids:
            return None, list(body.prompt_token_ids)
        if body.chat_template is not None and not self.p.context.config.trust_request_chat_template:
            raise InvalidRequestError("chat_template in requests is disabled on this server "
                                      "(start it with --trust-request-chat-template)", param="chat_template")
        messages = []
        for i, m in enumerate(body.messages):
            msg = m.model_dump(exclude_none=True)
            msg["content"] = message_text(m.content, i) or ""
            messages.append(msg)
        if body.disable_chat_template:
            return "\n".join(m["content"] for m in messages), None
        tools = body.tools if body.tool_choice != "none" else None
        text = render_chat(self.p.context.engine.tokenizer, messages, tools=tools,
                           add_generation_prompt=body.add_generation_prompt is not False and not body.continue_final_message,
                           continue_final_message=bool(body.continue_final_message),
                           chat_template=body.chat_template, template_kwargs=body.chat_template_kwargs,
                           documents=body.documents)
        return text, None

    async def __call__(self, body: ChatCompletionRequest, request_id: str | None) -> Any:
        ctx = self.p.context
        model = ctx.check_model(body.model)
        sampling = chat_sampling(body)
        if body.stream and sampling.num_sequences > sampling.n:
            raise InvalidRequestError("best_of > n is not supported when streaming", param="best_of")
        mask_factory = await guided_mask(ctx, body)
        prompt, prompt_ids = self.render(body)
        req = new_request(body, sampling, prompt=prompt, prompt_ids=prompt_ids, header_id=request_id,
                          add_special_tokens=False, mask_factory=mask_factory)
        ctx.engine.prepare(req, param="messages")
        rid = f"chatcmpl-{body.request_id or request_id or uuid.uuid4().hex}"
        head = {"id": rid, "object": "chat.completion", "created": now(), "model": model}
        if body.stream:
            head["object"] = "chat.completion.chunk"
            return StreamingResponse(self._stream(body, req, head), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        return JSONResponse(await self._complete(body, req, head))

    async def _complete(self, body: ChatCompletionRequest, req: Any, head: dict) -> dict:
        n = req.sampling.n
        acc: dict[int, dict] = {}
        usage = (0, 0, 0)
        async for _, event in self.p.context.engine.generate_many([req]):
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
        for index in sorted(acc):
            c = acc[index]
            prefix = (body.messages[-1].content or "") if body.echo and isinstance(body.messages[-1].content, str) else ""
            choice = {"index": index, "message": {"role": "assistant", "content": prefix + c["text"]},
                      "logprobs": {"content": chat_logprobs(c["lps"], self.tt), "refusal": None}
                      if body.logprobs else None,
                      "finish_reason": c["finish"], "stop_reason": c["stop"]}
            if body.return_token_ids:
                choice["prompt_token_ids"] = req.prompt_token_ids
                choice["token_ids"] = c["ids"]
            choices.append(choice)
        return {**head, "choices": choices, "usage": usage_dict(*usage)}

    async def _stream(self, body: ChatCompletionRequest, req: Any, head: dict) -> AsyncIterator[str]:
        opts = body.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        usage = (len(req.prompt_token_ids), 0, 0)
        started: set[int] = set()

        def chunk(choice: dict) -> str:
            out = {**head, "choices": [choice]}
            if include_usage:
                out["usage"] = usage_dict(*usage) if continuous else None
            return sse(out)

        try:
            async for _, event in self.p.context.engine.generate_many([req]):
                usage = (event.usage.prompt_tokens, event.usage.completion_tokens, event.usage.cached_tokens)
                for d in event.outputs:
                    if d.index not in started:
                        started.add(d.index)
                        first = {"role": "assistant", "content": ""}
                        if body.echo and isinstance(body.messages[-1].content, str):
                            first["content"] = body.messages[-1].content
                        yield chunk({"index": d.index, "delta": first, "logprobs": None, "finish_reason": None})
                    delta: dict[str, Any] = {"content": d.text} if d.text or not d.finish_reason else {}
                    choice = {"index": d.index, "delta": delta, "logprobs": None,
                              "finish_reason": d.finish_reason}
                    if d.finish_reason:
                        choice["stop_reason"] = d.stop_reason
                    if body.logprobs and d.logprobs:
                        choice["logprobs"] = {"content": chat_logprobs(d.logprobs, self.tt), "refusal": None}
                    if body.return_token_ids:
                        choice["token_ids"] = d.token_ids
                    yield chunk(choice)
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage_dict(*usage)})
        except Exception as exc:  # noqa: BLE001 - after the 200, errors travel in-band
            yield sse_error(to_error(exc))
        yield "data: [DONE]\n\n"
