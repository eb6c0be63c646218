"""TGI's parameter rules (router/src/validation.rs, same order and wording) and their
translation into core requests."""

from __future__ import annotations

import json
import random
import uuid
from dataclasses import dataclass, field
from typing import Any

from llmserve import InvalidRequestError
from llmserve import GuidedSpec
from llmserve import GenerateRequest, RequestPolicy
from llmserve import SamplingParams
from llmserve import after_cut

from .wire import GenerateParameters, Grammar, TGIGenerateRequest, TGIOptions

MAX_INPUT_CHARS = 4 * 1024 * 1024  # MindIE: 0 < characters <= 4 MB
TGI_DEFAULT_GENERATION_LENGTH = 1024  # current TGI's cap when max_new_tokens is absent
NO_ADAPTER = ("", "None")  # MindIE's documented default is the string "None"
# Errors about the prompt name ``inputs``, and the sampling fields as TGI spells them.
POLICY = RequestPolicy(prompt="inputs", names={"max_tokens": "max_new_tokens", "logprobs": "top_n_tokens"})


def invalid(message: str, param: str | None = None) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


@dataclass
class Plan:
    """A validated TGI request: what to run and how to answer."""

    inputs: str
    prompt_ids: list[int]
    sampling: SamplingParams
    best_of: int = 1
    sampled: bool = False
    seeds: list[int | None] = field(default_factory=list)
    details: bool = False
    decoder_input_details: bool = False
    top_n_tokens: int = 0
    return_full_text: bool = False
    guided: GuidedSpec | None = None
    mask_factory: Any = None
    media: tuple[Any, ...] = ()  # the images of ``inputs``, expanded into ``prompt_ids``

    @property
    def input_length(self) -> int:
        return len(self.prompt_ids)

    def requests(self) -> list[GenerateRequest]:
        """One core request per sequence (best_of runs best_of independent requests, each with
        its own seed, as TGI does)."""
        base = uuid.uuid4().hex
        out = []
        for i, seed in enumerate(self.seeds):
            sampling = self.sampling.model_copy(update={"seed": seed})
            out.append(GenerateRequest(prompt_token_ids=list(self.prompt_ids), sampling=sampling,
                                       request_id=f"tgi-{base}" + (f"-{i}" if len(self.seeds) > 1 else ""),
                                       mask_factory=self.mask_factory, media=self.media))
        return out


def _grammar_spec(grammar: Grammar) -> GuidedSpec:
    """TGI's grammar forms -> a GuidedSpec; TGI's "grammar is not valid: ..." on bad values."""
    kind, value = grammar.type, grammar.value
    if kind in ("json", "json_object"):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise invalid(f"grammar is not valid: {exc}", "grammar") from None
        if value is None or value == {}:
            if kind == "json_object":
                return GuidedSpec("json_object", None, param="grammar")
            raise invalid("grammar is not valid: `value` must be a JSON schema", "grammar")
        if not isinstance(value, dict):
            raise invalid("grammar is not valid: `value` must be a JSON schema object (or a string holding one)",
                          "grammar")
        return GuidedSpec("json_schema", value, param="grammar")
    if kind == "json_schema":
        schema = value.get("schema") if isinstance(value, dict) else None
        if not isinstance(schema, dict):
            raise invalid("grammar is not valid: `value` must be {\"name\": ..., \"schema\": {...}} with a JSON "
                          "schema object", "grammar")
        return GuidedSpec("json_schema", schema, param="grammar")
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise invalid("grammar is not valid: `value` must be a non-empty regular expression", "grammar")
        return GuidedSpec("regex", value, param="grammar")
    raise invalid(f"grammar is not valid: unknown grammar type {kind!r}; expected json, json_object, "
                  f"json_schema or regex", "grammar")


def _server_rules(body: TGIGenerateRequest, p: GenerateParameters, opts: TGIOptions, stream: bool) -> int:
    """What this server does not serve, then server.rs's best_of and streaming rules; ``best_of``."""
    if not isinstance(body.inputs, str):
        raise invalid("`inputs` must be a string: multimodal inputs are not supported by this server", "inputs")
    if p.adapter_id is not None and p.adapter_id not in NO_ADAPTER:
        raise invalid(f"`adapter_id` {p.adapter_id!r} is not available: this server does not serve LoRA adapters "
                      f"(send null)", "adapter_id")
    if p.watermark:
        raise invalid("`watermark` is not supported by this server (send false or null)", "watermark")
    best_of = 1 if p.best_of is None else p.best_of
    if best_of != 1 and opts.max_best_of == 1:
        raise invalid("`best_of` != 1 is not allowed for this endpoint", "best_of")
    if best_of < 1 or best_of > opts.max_best_of:
        raise invalid(f"`best_of` must be > 0 and <= {opts.max_best_of}. Given: {best_of}", "best_of")
    if stream and best_of != 1:
        raise invalid("`best_of` != 1 is not supported when streaming tokens", "best_of")
    if stream and p.decoder_input_details:
        raise invalid("`decoder_input_details` == true is not supported when streaming tokens",
                      "decoder_input_details")
    return best_of


def _parameters(body: TGIGenerateRequest, p: GenerateParameters, opts: TGIOptions, best_of: int,
                max_input: int) -> tuple[bool, float, float, float, list[str], int]:
    """validation.rs's parameter rules, in its order: (sampled, temperature,
    repetition_penalty, frequency_penalty, stop, top_n_tokens)."""
    sampled = bool(p.do_sample) or any(v is not None for v in (p.temperature, p.top_k, p.top_p, p.typical_p))
    if best_of > 1 and not sampled:
        raise invalid("you must use sampling when `best_of` is > 1", "best_of")
    temperature = 1.0 if p.temperature is None else p.temperature
    if temperature <= 0.0:
        raise invalid("`temperature` must be strictly positive", "temperature")
    repetition_penalty = 1.0 if p.repetition_penalty is None else p.repetition_penalty
    if repetition_penalty <= 0.0:
        raise invalid("`repetition_penalty` must be strictly positive", "repetition_penalty")
    frequency_penalty = 0.0 if p.frequency_penalty is None else p.frequency_penalty
    if not -2.0 <= frequency_penalty <= 2.0:
        raise invalid("`frequency_penalty` must be >= -2.0 and <= 2.0", "frequency_penalty")
    if p.top_p is not None and not 0.0 < p.top_p < 1.0:
        raise invalid("`top_p` must be > 0.0 and < 1.0", "top_p")
    if p.typical_p is not None and not 0.0 < p.typical_p < 1.0:
        raise invalid("`typical_p` must be > 0.0 and < 1.0", "typical_p")
    if p.top_k is not None and p.top_k <= 0:
        raise invalid("`top_k` must be strictly positive", "top_k")
    if p.max_new_tokens is not None and p.max_new_tokens <= 0:
        raise invalid("`max_new_tokens` must be strictly positive", "max_new_tokens")
    stop = [p.stop] if isinstance(p.stop, str) else list(p.stop or [])
    if len(stop) > opts.max_stop_sequences:
        raise invalid(f"`stop` supports up to {opts.max_stop_sequences} stop sequences. Given: {len(stop)}", "stop")
    if any(s == "" for s in stop):
        raise invalid("`stop` sequences must not be empty strings", "stop")
    if p.seed is not None and best_of > 1:
        raise invalid("`seed` must not be set when `best_of` > 1", "seed")
    top_n = 0 if p.top_n_tokens is None else p.top_n_tokens
    if not 0 <= top_n <= opts.max_top_n_tokens:
        raise invalid(f"`top_n_tokens` must be >= 0 and <= {opts.max_top_n_tokens}. Given: {top_n}", "top_n_tokens")
    if not body.inputs:
        raise invalid("`inputs` cannot be empty", "inputs")
    if len(body.inputs) > MAX_INPUT_CHARS:
        raise invalid(f"`inputs` must have at most {MAX_INPUT_CHARS} characters. Given: {len(body.inputs)}", "inputs")
    if p.truncate is not None and (p.truncate <= 0 or p.truncate > max_input):
        raise invalid(f"`truncate` must be strictly positive and less than {max_input}. Given: {p.truncate}",
                      "truncate")
    return sampled, temperature, repetition_penalty, frequency_penalty, stop, top_n


def _input(body: TGIGenerateRequest, p: GenerateParameters, opts: TGIOptions, engine: Any, max_total: int,
           max_input: int, text: str, images: list[Any]) -> tuple[list[int], int, tuple[Any, ...]]:
    """validate_input: tokenize (``text``: the inputs with their images' placeholders), expand the
    images, truncate, then the length rules; (prompt ids, max_new_tokens, images)."""
    add_special = body.add_special_tokens is not False
    ids = engine.encode(text, add_special_tokens=add_special)
    media: tuple[Any, ...] = ()
    if images:
        ids, media = engine.info.media.expand(ids, images, "inputs")
    if p.truncate is not None and len(ids) > p.truncate:
        media = after_cut(media, len(ids) - p.truncate, "`truncate` would cut into an image of `inputs`", "truncate")
        ids = ids[-p.truncate:]
    input_length = len(ids)
    if not ids:
        raise invalid("`inputs` cannot be empty", "inputs")
    if p.max_new_tokens is not None:
        max_new_tokens = p.max_new_tokens
    elif opts.default_max_new_tokens is not None:
        max_new_tokens = opts.default_max_new_tokens
    else:
        max_new_tokens = max(1, min(max_total - input_length, TGI_DEFAULT_GENERATION_LENGTH))
    if input_length + max_new_tokens > max_total:
        raise invalid(f"`inputs` tokens + `max_new_tokens` must be <= {max_total}. Given: {input_length} `inputs` "
                      f"tokens and {max_new_tokens} `max_new_tokens`", "max_new_tokens")
    if input_length > max_input:
        raise invalid(f"`inputs` must have less than {max_input} tokens. Given: {input_length}", "inputs")
    return ids, max_new_tokens, media


def validate(body: TGIGenerateRequest, opts: TGIOptions, engine: Any, *, stream: bool,
             default_full_text: bool = False, text: Any = None, images: list[Any] | None = None) -> Plan:
    """Check ``body`` as TGI does and build the plan. Raises InvalidRequestError (-> 422).
    ``text``/``images``: the inputs with their Markdown images taken out (``images.py``)."""
    p = body.parameters or GenerateParameters()
    max_total = engine.max_model_len
    max_input = min(opts.max_input_tokens or max_total - 1, max_total - 1)
    best_of = _server_rules(body, p, opts, stream)
    sampled, temperature, repetition_penalty, frequency_penalty, stop, top_n = _parameters(body, p, opts, best_of,
                                                                                            max_input)
    ids, max_new_tokens, media = _input(body, p, opts, engine, max_total, max_input,
                                        body.inputs if text is None else text, images or [])

    guided = _grammar_spec(p.grammar) if p.grammar is not None else None
    details = bool(p.details) or bool(p.decoder_input_details)
    sampling = SamplingParams.build(
        POLICY.names, temperature=temperature if sampled else 0.0,
        top_k=p.top_k, top_p=p.top_p, typical_p=p.typical_p,
        repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
        stop=stop, include_stop_str_in_output=True,  # TGI keeps the matched stop text
        max_tokens=max_new_tokens,
        logprobs=top_n,  # every TGI token carries its logprob; top_n_tokens adds alternatives
        prompt_logprobs=0 if p.decoder_input_details else None,
    )
    if sampled:
        seeds = [p.seed if p.seed is not None else random.getrandbits(63)] if best_of == 1 else \
            [random.getrandbits(63) for _ in range(best_of)]
    else:
        seeds = [None]
    full_text = default_full_text if p.return_full_text is None else p.return_full_text
    return Plan(inputs=body.inputs, prompt_ids=ids, sampling=sampling, best_of=best_of, sampled=sampled,
                seeds=seeds, details=details, decoder_input_details=bool(p.decoder_input_details),
                top_n_tokens=top_n, return_full_text=full_text, guided=guided, media=media)
