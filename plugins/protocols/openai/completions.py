"""POST /v1/completions: str / list[str] / token-id prompts, echo, logprobs, n, best_of, streaming."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.responses import JSONResponse

from llmserve import InvalidRequestError
from llmserve import RequestPolicy
from llmserve import TokenLogprob
from llmserve import ChainMaker, ParseChain
from llmserve import SSE_DONE, STREAM_HEADERS, sse
from llmserve import to_error

from .params import completion_sampling, guided_mask, new_request, now, truncate, truncation
from .replies import SYSTEM_FINGERPRINT, Endpoint, completion_logprobs, prompt_logprobs, usage_dict
from .wire import CompletionRequest

# An output longer than the room is cut to it (OpenAI's API), or refused under --strict-max-tokens.
COMPLETION = RequestPolicy(prompt="prompt", length="fit")


def split_prompts(prompt: Any) -> list[tuple[str | None, list[int] | None]]:
    if isinstance(prompt, str):
        return [(prompt, None)]
    if not prompt:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [(None, list(prompt))]
    if all(isinstance(p, str) for p in prompt):
        return [(p, None) for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        if any(not p for p in prompt):
            raise InvalidRequestError("prompt must not contain empty token lists", param="prompt")
        return [(None, list(p)) for p in prompt]
    raise InvalidRequestError("prompt must be a string, a list of strings, or token ids", param="prompt")


@dataclass
class Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: Any = None


class Completions(Endpoint):

    async def __call__(self, body: CompletionRequest, request_id: str | None) -> Any:
        ctx = self.p.context
        engine = ctx.engine
        model = ctx.check_model(body.model)
        sampling = completion_sampling(body, engine.info.vocab_size, engine.limits.max_logprobs)
        keep = truncation(body, engine.max_model_len)
        if body.stream and sampling.num_sequences > sampling.n:
            raise InvalidRequestError("best_of > n is not supported when streaming", param="best_of")
        prompts = split_prompts(body.prompt)
        mask_factory = await guided_mask(ctx, body)
        # With --reasoning-parser the thinking moves to reasoning_content (not for constrained output).
        chains = ctx.parsing.chains(engine.tokenizer, None, constrained=mask_factory is not None)
        make_chain, sampling = chains.make, chains.keep_markers(sampling)
        base = body.request_id or request_id or uuid.uuid4().hex
        reqs = []
        for i, (text, ids) in enumerate(prompts):
            if keep is not None:
                if ids is None:
                    ids = await engine.aencode(text or "", body.add_special_tokens is not False)
                text, ids = None, truncate(ids, keep, body.truncation_side)
            req = new_request(body, sampling, prompt=text, prompt_ids=ids, header_id=base,
                              add_special_tokens=body.add_special_tokens is not False,
                              suffix=f"-{i}" if len(prompts) > 1 else "", mask_factory=mask_factory)
            reqs.append(await engine.aprepare(req, COMPLETION))
        rid = f"cmpl-{base}"
        head = {"id": rid, "object": "text_completion", "created": now(), "model": model,
                "system_fingerprint": SYSTEM_FINGERPRINT}
        if body.stream:
            return ctx.sse_response(self._stream(body, reqs, head, make_chain), headers=STREAM_HEADERS)
        return JSONResponse(await self._complete(body, reqs, head, make_chain))

    def _prompt_text(self, req: Any) -> str:
        return req.prompt if req.prompt is not None else self.p.context.engine.decode(req.prompt_token_ids, False)

    def _echo_items(self, req: Any, prompt_lp: list | None) -> list[tuple[int, TokenLogprob | None]]:
        lps = list(prompt_lp or [])
        lps += [None] * (len(req.prompt_token_ids) - len(lps))
        return list(zip(req.prompt_token_ids, lps))

    async def _complete(self, body: CompletionRequest, reqs: list, head: dict, make_chain: ChainMaker | None) -> dict:
        n = reqs[0].sampling.n
        choices: dict[int, Choice] = {}
        prompt_lps: dict[int, list] = {}
        usage = [0, 0, 0]
        async for i, event in self.p.context.engine.generate_many(reqs):
            if event.prompt_logprobs is not None:
                prompt_lps[i] = event.prompt_logprobs
            for d in event.outputs:
                if d.index >= n:
                    continue  # best_of: only the n best are returned
                c = choices.setdefault(i * n + d.index, Choice())
                c.text += d.text
                c.token_ids += d.token_ids
                c.logprobs += d.logprobs or []
                if d.finish_reason:
                    c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
            if event.finished:
                usage[0] += event.usage.prompt_tokens
                usage[1] += event.usage.completion_tokens
                usage[2] += event.usage.cached_tokens
        out = []
        labels = self.labels(body)
        for index in sorted(choices):
            c, req = choices[index], reqs[index // n]
            prefix = self._prompt_text(req) if body.echo else ""
            # vLLM's choice always carries its extra keys, null unless asked for.
            item = {"index": index, "text": prefix + c.text, "logprobs": None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason, "token_ids": None,
                    "prompt_logprobs": prompt_logprobs(prompt_lps.get(index // n), self.tt,
                                                       req.sampling.prompt_logprobs or 0),
                    "prompt_token_ids": None}
            if make_chain is not None:
                parsed = make_chain().parse(c.text)
                item["text"] = prefix + (parsed["content"] or "")
                item["reasoning_content"] = parsed["reasoning_content"]
            if body.logprobs is not None:
                items = self._echo_items(req, prompt_lps.get(index // n)) if body.echo else []
                items += list(zip(c.token_ids, c.logprobs))
                item["logprobs"] = completion_logprobs(items, labels, 0, req.sampling.logprobs or 0)
            if body.return_token_ids:
                item["prompt_token_ids"] = req.prompt_token_ids
                item["token_ids"] = c.token_ids
            out.append(item)
        return {**head, "choices": out, "usage": usage_dict(*usage)}

    async def _stream(self, body: CompletionRequest, reqs: list, head: dict,
                      make_chain: ChainMaker | None) -> AsyncIterator[str]:
        n = reqs[0].sampling.n
        opts = body.stream_options
        include_usage = bool(opts and opts.include_usage) or self.p.context.config.parsing.enable_force_include_usage
        continuous = bool(opts and opts.continuous_usage_stats)
        started: set[int] = set()
        labels = self.labels(body)
        chains: dict[int, ParseChain] = {}
        offsets: dict[int, int] = {}
        totals: dict[int, tuple[int, int, int]] = {}
        try:
            async for i, event in self.p.context.engine.generate_many(reqs):
                req = reqs[i]
                totals[i] = (event.usage.prompt_tokens, event.usage.completion_tokens, event.usage.cached_tokens)
                for d in event.outputs:
                    index = i * n + d.index
                    text, items = d.text, list(zip(d.token_ids, d.logprobs or []))
                    reasoning = None
                    if make_chain is not None:
                        chain = chains.get(index) or chains.setdefault(index, make_chain())
                        parsed = chain.feed(text, d.token_ids)
                        if d.finish_reason:
                            parsed.extend(chain.finish())
                        text, reasoning = parsed.content, parsed.reasoning or None
                    first = index not in started
                    if first:
                        started.add(index)
                        if body.echo:
                            text = self._prompt_text(req) + text
                            items = self._echo_items(req, event.prompt_logprobs) + items
                    choice = {"index": index, "text": text, "logprobs": None,
                              "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}
                    if make_chain is not None:
                        choice["reasoning_content"] = reasoning
                    if body.logprobs is not None:
                        choice["logprobs"] = completion_logprobs(items, labels, offsets.get(index, 0),
                                                                 req.sampling.logprobs or 0)
                    offsets[index] = offsets.get(index, 0) + len(text)
                    if body.return_token_ids:
                        choice["token_ids"] = d.token_ids
                        if first:
                            choice["prompt_token_ids"] = req.prompt_token_ids
                    chunk = {**head, "choices": [choice]}
                    if include_usage:
                        chunk["usage"] = usage_dict(*self._sum(totals)) if continuous else None
                    yield sse(chunk)
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage_dict(*self._sum(totals))})
        except Exception as exc:  # noqa: BLE001 - after the 200, errors travel in-band
            yield sse(self.p.error_body(to_error(exc))[1])
        yield SSE_DONE

    @staticmethod
    def _sum(totals: dict[int, tuple[int, int, int]]) -> tuple[int, int, int]:
        return tuple(sum(t[k] for t in totals.values()) for k in range(3))  # type: ignore[return-value]
