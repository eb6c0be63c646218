"""Dialect-neutral sampling parameters, validated once at the edge of the core."""

from __future__ import annotations

from typing import Any, Callable, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from llmserve.errors import InvalidRequestError

# Hard caps that protect the server; dialects may lower them with their own limits.
MAX_N = 128
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries of logit_bias, and of bad_words / bad_words_token_ids
# Multipliers past these leave float32's range (1e300 becomes inf, 1e-300 becomes 0) and turn
# logits into NaN; nothing useful lies beyond them.
MIN_SCALE, MAX_SCALE = 1e-6, 1e6


class SamplingParams(BaseModel):
    """How to pick tokens for one request.

    Neutral defaults mean "off": temperature 1.0 with every filter disabled samples the model's
    distribution; ``temperature == 0`` is greedy decoding. Dialects translate their own fields
    to these (OpenAI ``max_completion_tokens`` -> ``max_tokens``, TGI ``do_sample=false`` ->
    ``temperature=0`` and so on) and never see the engine's internal state.
    """

    # Frozen: validated once, then only copied (``model_copy``), never changed in place.
    model_config = ConfigDict(extra="forbid", frozen=True)

    n: int = Field(1, ge=1, le=MAX_N, description="Sequences returned.")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="Sequences generated; the n best are returned.")
    temperature: float = Field(1.0, ge=0.0, le=MAX_SCALE, description="0 means greedy, else at least 1e-6.")
    top_k: int = Field(0, ge=-1, description="0 or -1 disables.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    typical_p: float = Field(1.0, gt=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, ge=MIN_SCALE, le=MAX_SCALE)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[int, float] = Field(default_factory=dict, max_length=MAX_LOGIT_BIAS,
                                         description="token id -> bias in [-100, 100].")
    bad_words: list[str] = Field(default_factory=list, max_length=MAX_LOGIT_BIAS, description="Words never generated.")
    bad_words_token_ids: list[list[int]] = Field(default_factory=list, max_length=MAX_LOGIT_BIAS,
                                                 description="Token sequences never generated.")
    min_tokens: int = Field(0, ge=0)
    max_tokens: int | None = Field(None, ge=1, description="None: up to the context length.")
    ignore_eos: bool = False
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    seed: int | None = Field(None, ge=0, le=2**64 - 1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Top alternatives per sampled token.")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Top alternatives per prompt token.")
    logprobs_mode: Literal["raw", "processed"] = Field(
        "raw", description="raw: log-softmax of the model's logits; processed: after temperature and top-p."
    )
    allowed_token_ids: list[int] | None = Field(None, min_length=1, description="Only these tokens are sampled.")
    logprob_token_ids: list[int] | None = Field(
        None, min_length=1, max_length=MAX_LOGPROBS,
        description="The alternatives reported per sampled token are these tokens, instead of the best ones.")
    speculative: bool = Field(True, description="False: decode without speculative proposals even when the "
                                                "server has them on (the output is the same either way).")

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: dict[int, float]) -> dict[int, float]:
        for token, bias in value.items():
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias for token {token} must be in [-100, 100], got {bias}")
        return value

    @field_validator("temperature")
    @classmethod
    def _not_vanishing(cls, value: float) -> float:
        if 0.0 < value < MIN_SCALE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_SCALE:g}, got {value:g}")
        return value

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("stop strings must not be empty")
        return value

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> "SamplingParams":
        # A cross-field rule's message starts with the field it blames, in the client's words.
        name = _namer(info.context)
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"{name('best_of')} ({self.best_of}) must be >= {name('n')} ({self.n})")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"{name('min_tokens')} ({self.min_tokens}) must be <= {name('max_tokens')} "
                             f"({self.max_tokens})")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_sequences(self) -> int:
        """How many sequences the engine runs for this request (best_of, else n)."""
        return self.best_of or self.n

    @classmethod
    def build(cls, names: Mapping[str, str] | None = None, **fields: object) -> "SamplingParams":
        """Validate ``fields`` (None means default) and raise InvalidRequestError naming the field
        as the client sent it: ``names`` maps these fields to the dialect's own
        (``RequestPolicy.names``)."""
        from pydantic import ValidationError

        clean = {k: v for k, v in fields.items() if v is not None}
        name = _namer({"names": names})
        try:
            return cls.model_validate(clean, context={"names": names})
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = [str(p) for p in err["loc"]]
            msg = err["msg"].removeprefix("Value error, ")
            if not loc:
                blamed = msg.split(" ", 1)[0]
                if blamed in {name(f) for f in cls.model_fields}:
                    raise InvalidRequestError(msg, param=blamed) from None
                raise InvalidRequestError(msg) from None
            param = ".".join([name(loc[0]), *loc[1:]])
            raise InvalidRequestError(f"{param}: {msg}", param=param) from None


def _namer(context: Any) -> Callable[[str], str]:
    """The client's name of a field, from the validation context's ``names`` (none: the core's)."""
    names = (context or {}).get("names") or {}
    return lambda field: names.get(field, field)
