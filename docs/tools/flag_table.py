"""Print the `llmserve serve` flag table (Markdown) from ServerConfig's sections."""
import json
from typing import Literal, get_args, get_origin

from pydantic import BaseModel

from llmserve.config import ENV_PREFIX, FIELDS, FLAG_ALIASES, _kind, field_owner, flag_name


def type_of(field):
    ann = field_owner(field).model_fields[field].annotation
    args = [a for a in get_args(ann) if a is not type(None)]
    if get_origin(ann) is not Literal and len(args) == 1 and get_origin(args[0]) is Literal:
        ann = args[0]  # Optional[Literal[...]]: the choices, or unset
    if get_origin(ann) is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in get_args(ann))
    kind = _kind(field)
    if kind == "list":
        return "list of strings"
    if kind == "dict":
        return "`NAME=PREFIX` pairs"
    base = args[0] if args and get_origin(ann) is not None else ann
    if isinstance(base, type) and issubclass(base, BaseModel):
        return "JSON object"
    return {str: "string", int: "integer", float: "number", bool: "boolean"}[base]


def default_of(field):
    info = field_owner(field).model_fields[field]
    value = info.get_default(call_default_factory=True)
    return "—" if value is None else f"`{json.dumps(value)}`"


def flag_of(field):
    flag = flag_name(field)
    if field == "model":
        return "`MODEL` (argument) or `--model`"
    aliases = "".join(f" (also `{a}`)" for a in FLAG_ALIASES.get(field, ()))
    if _kind(field) == "bool":
        return f"`{flag}` / `--no-{flag[2:]}`{aliases}"
    return f"`{flag}`{aliases}"


print("| Flag | Type | Default | Environment variable | Description |")
print("|---|---|---|---|---|")
for f in FIELDS:
    desc = (field_owner(f).model_fields[f].description or "").replace("|", "\\|")
    print(f"| {flag_of(f)} | {type_of(f)} | {default_of(f)} | `{ENV_PREFIX}{f.upper()}` | {desc} |")
