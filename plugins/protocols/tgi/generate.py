"""TGI's generation routes: ``/generate`` and ``POST /`` (one JSON reply, best_of, details,
prefill tokens, TGI's ``x-*`` headers) and ``/generate_stream`` (SSE, one event per token)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, AsyncGenerator, Protocol

from starlette.responses import JSONResponse, Response

from llmserve import InvalidRequestError
from llmserve import PreparedRequest
from llmserve import STREAM_HEADERS, ErrorFormat, in_band_errors, load_images, reads_images, sse

from .images import split_images
from .params import POLICY, Plan, validate
from .tokens import Sequence, TokenFactory
from .wire import TGIGenerateRequest, TGIOptions

if TYPE_CHECKING:
    from llmserve import ServerContext


class TGIHost(ErrorFormat, Protocol):
    """What the routes use of their ``TGIProtocol``, typed structurally: ``protocol.py`` imports
    this module, so importing it back would close a circle."""

    context: ServerContext
    opts: TGIOptions

    @property
    def tokens(self) -> TokenFactory: ...


class Generate:
    """The generation routes of one ``TGIProtocol``."""

    def __init__(self, protocol: TGIHost) -> None:
        self.p = protocol

    async def _plan(self, body: TGIGenerateRequest, *, stream: bool, default_full_text: bool) -> Plan:
        engine = self.p.context.engine
        text, images = body.inputs, []
        if isinstance(body.inputs, str):  # --max-prompt-chars at once, then tokenizing in a worker thread
            engine.limits.check_prompt(body.inputs, "inputs")
            if "![" in body.inputs and reads_images(engine.info):  # Markdown images, for a model that reads them
                media = self.p.context.config.media
                text, parts = split_images(body.inputs, engine.info.media.placeholder, media.max_image_bytes)
                images = await load_images(parts, media) if parts else []
        plan = await engine.in_worker(validate, body, self.p.opts, engine, stream=stream,
                                      default_full_text=default_full_text, text=text, images=images)
        if plan.guided is not None:
            try:
                plan.mask_factory = await self.p.context.guided.compile_async(plan.guided)
            except InvalidRequestError as exc:
                msg = exc.message.removeprefix("grammar: ")
                if "needs a guided-decoding plugin" in msg:
                    raise InvalidRequestError(f"grammar is not supported: {msg}", param="grammar") from None
                raise InvalidRequestError(f"grammar is not valid: {msg}", param="grammar") from None
        return plan

    def _prepared(self, plan: Plan) -> list[PreparedRequest]:
        # A bad request fails here, with a status code; the prompt is already tokenized.
        return [self.p.context.engine.prepare(req, POLICY) for req in plan.requests()]

    def _full(self, plan: Plan, text: str) -> str:
        return plan.inputs + text if plan.return_full_text else text

    def _admit(self, body: TGIGenerateRequest) -> None:
        """Admission first, before validation tokenizes (TGI clients expect 429 when full)."""
        best_of = body.parameters.best_of if body.parameters is not None else None
        self.p.context.admission.check(best_of if isinstance(best_of, int) and best_of > 1 else 1)

    async def __call__(self, body: TGIGenerateRequest, as_list: bool = False,
                       default_full_text: bool = False) -> Response:
        start = time.time()
        self._admit(body)
        plan = await self._plan(body, stream=False, default_full_text=default_full_text)
        reqs = self._prepared(plan)
        seqs = [Sequence(self.p.tokens, plan.prompt_ids, plan.top_n_tokens) for _ in reqs]
        prompt_lps: dict[int, Any] = {}
        first_token: float | None = None
        async for i, event in self.p.context.engine.generate_many(reqs):
            if event.prompt_logprobs is not None:
                prompt_lps[i] = event.prompt_logprobs
            for delta in event.outputs:
                seqs[i].feed(delta)
            if first_token is None and event.timings.first_token is not None:
                first_token = event.timings.first_token
        order = sorted(range(len(seqs)), key=lambda i: seqs[i].mean_logprob, reverse=True) \
            if len(seqs) > 1 else [0]
        best = order[0]

        def details_of(i: int, *, best_of_entry: bool = False) -> dict:
            seq = seqs[i]
            out: dict[str, Any] = {}
            if best_of_entry:
                out["generated_text"] = self._full(plan, seq.text)
            out.update({"finish_reason": seq.finish_reason or "length", "generated_tokens": len(seq.tokens),
                        "seed": plan.seeds[i],
                        "prefill": self.p.tokens.prefill(plan.prompt_ids, prompt_lps.get(i))
                        if plan.decoder_input_details else [],
                        "tokens": seq.tokens})
            if plan.top_n_tokens:
                out["top_tokens"] = seq.top_tokens
            return out

        response: dict[str, Any] = {"generated_text": self._full(plan, seqs[best].text)}
        if plan.details:
            details = details_of(best)
            if plan.best_of > 1:
                details["best_of_sequences"] = [details_of(i, best_of_entry=True) for i in order[1:]]
            response["details"] = details
        total = time.time() - start
        generated = len(seqs[best].tokens)
        headers = {"x-compute-type": "llmserve", "x-compute-time": f"{total:.6f}",
                   "x-compute-characters": str(len(plan.inputs)), "x-total-time": str(int(total * 1000)),
                   "x-prompt-tokens": str(plan.input_length), "x-generated-tokens": str(generated),
                   "x-time-per-token": str(int(total * 1000 / max(generated, 1)))}
        return JSONResponse([response] if as_list else response, headers=headers)

    async def stream(self, body: TGIGenerateRequest, default_full_text: bool = False) -> Response:
        self._admit(body)
        plan = await self._plan(body, stream=True, default_full_text=default_full_text)
        reqs = self._prepared(plan)
        headers = {**STREAM_HEADERS, "x-compute-type": "llmserve", "x-compute-characters": str(len(plan.inputs))}
        return self.p.context.sse_response(in_band_errors(self.p, self._stream(plan, reqs[0]), sse), headers=headers)

    async def _stream(self, plan: Plan, req: Any) -> AsyncGenerator[str, None]:
        seq = Sequence(self.p.tokens, plan.prompt_ids, plan.top_n_tokens)
        index = 0
        ended = False
        async for event in self.p.context.engine.generate(req):
            for delta in event.outputs:
                new = seq.feed(delta)
                finished = delta.finish_reason is not None
                if finished and not new:  # the request ended without a token (e.g. a deadline)
                    last_id = seq.tokens[-1]["id"] if seq.tokens else 0
                    new = [({"id": last_id, "text": "", "logprob": None, "special": True}, [])]
                for k, (token, top) in enumerate(new):
                    index += 1
                    last = finished and k == len(new) - 1
                    out: dict[str, Any] = {"index": index, "token": token}
                    if top:
                        out["top_tokens"] = top
                    out["generated_text"] = self._full(plan, seq.text) if last else None
                    out["details"] = {"finish_reason": seq.finish_reason, "generated_tokens": len(seq.tokens),
                                      "seed": plan.seeds[0], "input_length": plan.input_length} \
                        if last and plan.details else None
                    yield sse(out)
                ended = ended or finished
        if not ended:
            yield sse({"error": "Incomplete generation stream", "error_type": "incomplete_generation"})
