"""Schema and regex preparation for the lm-format-enforcer decoder.

Schemas are checked against their meta-schema (when ``jsonschema`` is installed) and
normalized into the subset LMFE's parser handles; regexes are compiled once to fail early.
Anything that cannot be enforced is refused with a 400 naming the request field.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import interegular
from lmformatenforcer import JsonSchemaParser
from lmformatenforcer import jsonschemaparser as _jsp
from lmformatenforcer.external.jsonschemaobject import JsonSchemaObject

from llmserve import InvalidRequestError

_ANY = {"anyOf": [{"type": t} for t in ("string", "number", "boolean", "null", "object", "array")]}
_SHAPE_KEYS = ("type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref")
_KEEP_AT_TOP = ("$defs", "definitions", "title", "description", "$schema", "$id", "examples", "default")
_REGEX_META = set("\\.^$|?*+()[]{}")


# -- regexes -------------------------------------------------------------------------------------
def escape_regex(text: str) -> str:
    """Escape ``text`` as a literal for interegular (``re.escape`` escapes too much for it)."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def compile_regex(pattern: str, label: str, param: str | None, build: bool = True) -> Any:
    """Check ``pattern`` (Python syntax, then what LMFE's FSM library supports), dropping the
    ``^`` and ``$`` anchors, which are implied. Returns interegular's FSM, or with
    ``build=False`` only parses (the FSM, the costly part, is then built by LMFE itself)."""
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise InvalidRequestError(f"{label}: invalid regular expression: {exc}", param=param) from None
    if pattern.startswith("^"):
        pattern = pattern[1:]
    if pattern.endswith("$") and (len(pattern) - len(pattern.rstrip("$").rstrip("\\"))) % 2 == 1:
        pattern = pattern[:-1]
    try:
        parsed = interegular.parse_pattern(pattern)
        return parsed.to_fsm() if build else None
    except Exception as exc:  # noqa: BLE001 - interegular raises several types
        why = str(exc) or type(exc).__name__
        raise InvalidRequestError(f"{label}: unsupported regular expression ({why})", param=param) from None


# -- JSON schemas --------------------------------------------------------------------------------
def prepare_schema(schema: Any, param: str | None, label: str | None = None) -> dict:
    """Validate ``schema`` and rewrite it into what LMFE enforces correctly. Problems are a 400
    naming ``param``; ``label`` starts the message (default: ``param``)."""
    return prepare_schema_context(schema, param, label)[0]


def prepare_schema_context(schema: Any, param: str | None, label: str | None = None) -> tuple[dict, Any]:
    """``prepare_schema`` and the LMFE parser context it built: every sub-schema's parts and
    every string pattern's automaton, built once here (masks share it)."""
    label = label or param or "json_schema"
    def bad(msg: str, path: str = "") -> InvalidRequestError:
        where = f" (at {path})" if path else ""
        return InvalidRequestError(f"{label}: {msg}{where}", param=param)

    if not isinstance(schema, dict):
        raise bad("the JSON schema must be a JSON object")
    try:
        from jsonschema.exceptions import SchemaError
        from jsonschema.validators import validator_for
    except ImportError:  # optional: the checks below still run
        validator_for = None
    if validator_for is not None:
        try:
            validator_for(schema).check_schema(schema)
        except SchemaError as exc:
            path = "/" + "/".join(str(p) for p in exc.absolute_path) if exc.absolute_path else ""
            raise bad(f"invalid JSON schema: {exc.message}", path) from None
    defs = {**(schema.get("definitions") or {}), **(schema.get("$defs") or {})}
    out = _normalize(schema, "", defs, bad)
    try:
        root = JsonSchemaParser(out)
    except Exception as exc:  # noqa: BLE001 - the enforcer raises many types; all mean an unsupported schema
        raise bad(f"unsupported JSON schema: {exc}") from None
    for path, sub in _subschemas(out, ""):
        try:
            _jsp.get_parser(root, JsonSchemaObject(**sub))
        except Exception as exc:  # noqa: BLE001 - as above, per subschema
            raise bad(f"unsupported JSON schema ({type(exc).__name__}: {exc})", path or "/") from None
    return out, root.context


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if key == "required":
            out[key] = list(dict.fromkeys([*out.get(key, []), *value]))
        elif key == "properties" and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def _normalize(node: Any, path: str, defs: dict, bad: Callable[..., InvalidRequestError]) -> dict:
    if node is True or node == {}:
        return dict(_ANY)
    if node is False:
        raise bad("a `false` schema accepts no value", path)
    if not isinstance(node, dict):
        raise bad("a schema must be a JSON object", path)

    def sub(value: Any, where: str) -> dict:
        return _normalize(value, f"{path}/{where}", defs, bad)

    s = _combinators(dict(node), path, defs, bad)
    if "anyOf" in s:
        siblings = {k: v for k, v in s.items() if k not in ("anyOf", *_KEEP_AT_TOP)}
        if siblings:  # LMFE ignores keywords beside anyOf: push them into each branch
            s = {**{k: s[k] for k in _KEEP_AT_TOP if k in s},
                 "anyOf": [_merge(siblings, b) if isinstance(b, dict) else b for b in s["anyOf"]]}
        s["anyOf"] = [sub(b, f"anyOf/{i}") for i, b in enumerate(s["anyOf"])]
        return s
    for key in ("properties", "$defs", "definitions"):
        if isinstance(s.get(key), dict):
            s[key] = {k: sub(v, f"{key}/{k}") for k, v in s[key].items()}
    if "items" in s and isinstance(s["items"], (dict, bool)):
        s["items"] = sub(s["items"], "items")
    if s.get("additionalProperties") is True:
        del s["additionalProperties"]
    elif isinstance(s.get("additionalProperties"), dict):
        s["additionalProperties"] = sub(s["additionalProperties"], "additionalProperties")
    if not any(k in s for k in _SHAPE_KEYS):
        if any(k in s for k in ("properties", "additionalProperties", "required")):
            s["type"] = "object"
        elif any(k in s for k in ("items", "minItems", "maxItems")):
            s["type"] = "array"
        elif any(k in s for k in ("pattern", "minLength", "maxLength")):
            s["type"] = "string"
        else:
            return {**s, **_ANY}
    if "const" in s:
        s["enum"] = [s.pop("const")]
    if "enum" in s:
        return _enum(s, path, bad)
    _check_leaf(s, path, defs, bad)
    return s


def _combinators(s: dict, path: str, defs: dict, bad: Callable[..., InvalidRequestError]) -> dict:
    """allOf merged into one schema, oneOf and a list of types turned into anyOf."""
    if "allOf" in s:  # merge into one schema (a bare local $ref is inlined first)
        merged = {k: v for k, v in s.items() if k != "allOf"}
        for i, part in enumerate(s["allOf"]):
            if isinstance(part, dict) and set(part) == {"$ref"}:
                part = defs.get(str(part["$ref"]).rsplit("/", 1)[-1], part)
            if isinstance(part, dict) and "$ref" in part and len(s["allOf"]) > 1:
                raise bad("allOf with a $ref among other schemas is not supported", f"{path}/allOf/{i}")
            merged = _merge(merged, part if isinstance(part, dict) else {})
        s = merged
    if "oneOf" in s:  # LMFE's oneOf only works for objects; anyOf is what it can enforce
        s["anyOf"] = [*s.get("anyOf", []), *s.pop("oneOf")]
    if isinstance(s.get("type"), list):
        types = s.pop("type")
        top = {k: s.pop(k) for k in _KEEP_AT_TOP if k in s}
        s = {**top, "anyOf": [{**s, "type": t} for t in types]}
    return s


def _check_leaf(s: dict, path: str, defs: dict, bad: Callable[..., InvalidRequestError]) -> None:
    """Refuse what the enforcer would get wrong: missing required properties, a pattern with length
    bounds or that does not compile, a $ref outside this schema's definitions."""
    if s.get("type") == "object":
        props = s.get("properties")
        if s.get("additionalProperties") is False and props is None:
            s["properties"] = props = {}
        missing = [k for k in s.get("required", []) if props is not None and k not in props]
        if missing:
            raise bad(f"required properties {missing} are not in properties", path)
    if s.get("type") == "string" and s.get("pattern") is not None:
        if "minLength" in s or "maxLength" in s:
            raise bad("a string pattern together with minLength/maxLength is not supported", path)
        try:
            compile_regex(s["pattern"], "", None, build=False)
        except InvalidRequestError as exc:
            raise bad("string pattern:" + exc.message, path) from None
    if "$ref" in s:
        ref = str(s["$ref"])
        if not re.fullmatch(r"#/(\$defs|definitions)/[^/]+", ref) or ref.rsplit("/", 1)[-1] not in defs:
            raise bad(f"$ref {ref!r} must point into this schema's $defs or definitions", path)


def _is_type(value: Any, t: str) -> bool:
    if t in ("number", "integer"):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok and (t == "number" or float(value).is_integer())
    return isinstance(value, {"string": str, "boolean": bool, "object": dict, "array": list}.get(t, type(None)))


def _enum(s: dict, path: str, bad: Callable[..., InvalidRequestError]) -> dict:
    """LMFE enforces an enum of strings or an enum of numbers: split the rest into anyOf."""
    values, t = s.pop("enum"), s.pop("type", None)
    if isinstance(t, str):
        values = [v for v in values if _is_type(v, t)]
    if any(isinstance(v, (dict, list)) for v in values):
        raise bad("enum/const values that are objects or arrays are not supported", path)
    bools = {v for v in values if isinstance(v, bool)}
    if len(bools) == 1:
        raise bad("an enum/const allowing only one of true and false is not supported", path)
    strings = [v for v in values if isinstance(v, str)]
    numbers = [v for v in values if _is_type(v, "number")]
    branches = ([{**s, "type": "string", "enum": strings}] if strings else []) + (
        [{**s, "enum": numbers}] if numbers else []) + (
        [{"type": "boolean"}] if bools else []) + ([{"type": "null"}] if None in values else [])
    if not branches:
        raise bad("enum has no value of the schema's type", path)
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


def _subschemas(s: Any, path: str):
    if not isinstance(s, dict):
        return
    yield path, s
    for key in ("properties", "$defs", "definitions"):
        for name, v in (s.get(key) or {}).items():
            yield from _subschemas(v, f"{path}/{key}/{name}")
    for i, v in enumerate(s.get("anyOf") or []):
        yield from _subschemas(v, f"{path}/anyOf/{i}")
    for key in ("items", "additionalProperties"):
        yield from _subschemas(s.get(key), f"{path}/{key}")
