"""vLLM's tokenizer routes: POST /tokenize (shared with TGI by body), /detokenize, GET /tokenizer_info."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import Field, model_validator
from starlette.responses import JSONResponse

from llmserve import InvalidRequestError
from llmserve import WireModel
from llmserve import message_text, render_chat

from .wire import ChatMessage


class TokenizeRequest(WireModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool | None = False

    @model_validator(mode="before")
    @classmethod
    def _one_way_to_end_the_prompt(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("continue_final_message") and data.get("add_generation_prompt"):
            raise InvalidRequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to "
                                      "True.", param="continue_final_message")
        return data


class DetokenizeRequest(WireModel):
    model: str | None = None
    tokens: list[int] = Field(min_length=0)


def accepts_tokenize(body: Any) -> bool:
    return isinstance(body, dict) and ("prompt" in body or "messages" in body)


class Tokens:
    def __init__(self, protocol: Any) -> None:
        self.p = protocol

    async def tokenize(self, body: TokenizeRequest) -> JSONResponse:
        ctx = self.p.context
        ctx.check_model(body.model)
        engine = ctx.engine
        if body.messages is not None:
            messages = [{**m.model_dump(exclude_none=True), "content": message_text(m.content, i) or ""}
                        for i, m in enumerate(body.messages)]
            # The bound of --max-prompt-chars before rendering too: the rendered text only grows.
            engine.limits.check_prompt_size(sum(len(m["content"]) for m in messages), "messages")
            # Off the event loop: a slow template (up to its render cap) delays only this request.
            text = await asyncio.to_thread(
                render_chat, engine.tokenizer, messages, tools=body.tools,
                add_generation_prompt=bool(body.add_generation_prompt) and not body.continue_final_message,
                continue_final_message=bool(body.continue_final_message), chat_template=body.chat_template,
                template_kwargs=body.chat_template_kwargs, trusted=ctx.config.parsing.trust_request_chat_template,
                timeout=ctx.config.parsing.chat_template_render_timeout)
            special = bool(body.add_special_tokens)  # the template already has its special tokens
        elif body.prompt is not None:
            text, special = body.prompt, body.add_special_tokens is not False
        else:
            raise InvalidRequestError("either prompt or messages is required", param="prompt")
        ids = await engine.aencode(text, special, param="messages" if body.messages is not None else "prompt")
        out: dict[str, Any] = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                               "token_strs": None}  # vLLM always sends the key
        if body.return_token_strs:
            out["token_strs"] = engine.tokenizer.convert_ids_to_tokens(ids)
        return JSONResponse(out)

    async def detokenize(self, body: DetokenizeRequest) -> JSONResponse:
        ctx = self.p.context
        ctx.check_model(body.model)
        vocab = ctx.engine.info.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is out of vocabulary (vocab size {vocab})", param="tokens")
        return JSONResponse({"prompt": ctx.engine.decode(body.tokens, skip_special_tokens=False)})

    async def tokenizer_info(self) -> JSONResponse:
        tok = self.p.context.engine.tokenizer
        info: dict[str, Any] = {"tokenizer_class": type(tok).__name__,
                                "model_max_length": self.p.context.engine.max_model_len,
                                "chat_template": getattr(tok, "chat_template", None)}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = getattr(tok, name, None)
            info[name] = value if isinstance(value, str) or value is None else str(value)
        return JSONResponse(info)
