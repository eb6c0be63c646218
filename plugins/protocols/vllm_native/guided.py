"""vLLM's spellings of an output constraint, read into the core's ``GuidedSpec``: the
``structured_outputs`` object (and its older name ``guided_decoding``), the legacy
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` fields, and
``guided_decoding_backend``.

The vLLM-native dialect reads them here; the OpenAI dialect accepts the same fields as vLLM's
extras and reads them with these functions too, so both answer with the same rules and errors.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from llmserve import InvalidRequestError
from llmserve import GuidedSpec, json_schema_spec

# vLLM's StructuredOutputsParams: the constraint keys (exactly one) and the options beside them.
STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "json_object"}
STRUCTURED_OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                      "whitespace_pattern", "structural_tag")
# vLLM's legacy request fields and the kind each asks for.
LEGACY_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
BACKEND_FIELD = "guided_decoding_backend"


def structured_outputs_spec(obj: Any, param: str = "structured_outputs") -> GuidedSpec | None:
    """vLLM's ``structured_outputs`` object -> a spec (None when it sets no constraint). Exactly
    one of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``; an unknown key, a
    ``structural_tag`` or a ``whitespace_pattern`` (not supported here) is a 400 naming it."""
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise InvalidRequestError(f"{param}: must be an object such as {{\"json\": {{...}}}}", param=param)
    unknown = [k for k in obj if k not in STRUCTURED_KINDS and k not in STRUCTURED_OPTIONS]
    if unknown:
        raise InvalidRequestError(f"{param}.{unknown[0]}: unknown structured-outputs key; expected one of "
                                  f"{', '.join(STRUCTURED_KINDS)}", param=f"{param}.{unknown[0]}")
    for key in ("structural_tag", "whitespace_pattern"):
        if obj.get(key) is not None:
            raise InvalidRequestError(f"{param}.{key}: not supported by this server", param=f"{param}.{key}")
    for key in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
        if obj.get(key) is not None and not isinstance(obj[key], bool):
            raise InvalidRequestError(f"{param}.{key}: must be a boolean", param=f"{param}.{key}")
    given = [k for k in STRUCTURED_KINDS if obj.get(k) is not None and not (k == "json_object" and obj[k] is False)]
    if len(given) > 1:
        raise InvalidRequestError(f"{param}: only one of {', '.join(STRUCTURED_KINDS)} may be given; got "
                                  f"{' and '.join(given)}", param=f"{param}.{given[1]}")
    if not given:
        return None
    key = given[0]
    where = f"{param}.{key}"
    if key == "json":
        spec = json_schema_spec(obj[key], where)
        if obj.get("disable_additional_properties"):
            spec = GuidedSpec("json_schema", closed_objects(spec.value), param=where)
        return spec
    if key == "json_object":
        if obj[key] is not True:
            raise InvalidRequestError(f"{where}: must be true", param=where)
        return GuidedSpec("json_object", None, param=where)
    return GuidedSpec(STRUCTURED_KINDS[key], obj[key], param=where)


def closed_objects(schema: Any, _depth: int = 0) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that does not say
    (vLLM's ``disable_additional_properties``). Only subschema positions are visited."""
    if _depth > 256 or not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub, _depth + 1) for name, sub in out[key].items()}
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub, _depth + 1) for sub in out[key]]
    for key in ("items", "additionalProperties", "not", "if", "then", "else"):
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key], _depth + 1)
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def legacy_specs(body: Any) -> dict[str, GuidedSpec | None]:
    """``{field: spec}`` for the legacy ``guided_*`` attributes ``body`` has set (``guided_json``
    may be a schema or a string holding one)."""
    out: dict[str, GuidedSpec | None] = {}
    for field, kind in LEGACY_FIELDS.items():
        value = getattr(body, field, None)
        if value is not None:
            spec = json_schema_spec(value, field) if kind == "json_schema" else GuidedSpec(kind, value, param=field)
            out[field] = spec
    return out


def with_backend(spec: GuidedSpec | None, body: Any) -> GuidedSpec | None:
    """``spec`` with the decoder the request named in ``guided_decoding_backend``, if it named one
    (an unknown or unfit decoder is then a 400 naming that field)."""
    backend = getattr(body, BACKEND_FIELD, None)
    if spec is None or backend is None:
        return spec
    return replace(spec, backend=backend, backend_param=BACKEND_FIELD)
