"""A model's chat template read from disk without loading the model (``llmserve parse --detect``):
from a Hugging Face directory (``chat_template.jinja``, ``chat_template.json`` or
``tokenizer_config.json``), from a GGUF file's ``tokenizer.chat_template`` metadata (the header
only: arrays such as the vocabulary are skipped, never decoded), or from a template file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, BinaryIO

from llmserve.errors import ConfigError

_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # type -> bytes
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_MAX_TEMPLATE_BYTES = 16 << 20  # a "template" larger than this is not read
_TEMPLATE_KEY = "tokenizer.chat_template"


def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _from_directory(path: Path) -> tuple[Any, dict[str, str]]:
    config: dict[str, Any] = {}
    config_file = path / "tokenizer_config.json"
    if config_file.is_file():
        try:
            loaded = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read {config_file}: {exc}") from None
        config = loaded if isinstance(loaded, dict) else {}
    tokens = {name: text for name in ("bos_token", "eos_token", "unk_token", "pad_token")
              if (text := _token_text(config.get(name))) is not None}
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8", errors="replace"), tokens
    as_json = path / "chat_template.json"
    if as_json.is_file():
        try:
            data = json.loads(as_json.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read {as_json}: {exc}") from None
        if isinstance(data, dict) and data.get("chat_template"):
            return data["chat_template"], tokens
    return config.get("chat_template"), tokens


def _read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ValueError("the GGUF header ends early")
    return data


def _skip(f: BinaryIO, vtype: int, depth: int = 0) -> None:
    if vtype in _GGUF_SCALARS:
        f.seek(_GGUF_SCALARS[vtype], 1)
    elif vtype == _GGUF_STRING:
        f.seek(struct.unpack("<Q", _read(f, 8))[0], 1)
    elif vtype == _GGUF_ARRAY and depth < 4:
        item, count = struct.unpack("<IQ", _read(f, 12))
        if item in _GGUF_SCALARS:
            f.seek(_GGUF_SCALARS[item] * count, 1)
        else:
            for _ in range(count):
                _skip(f, item, depth + 1)
    else:
        raise ValueError(f"unknown GGUF metadata type {vtype}")


def gguf_chat_template(path: Path) -> str | None:
    """The ``tokenizer.chat_template`` string of the GGUF file at ``path`` (``None`` when it
    has none); ``ConfigError`` when the file is not a GGUF this reader understands."""
    try:
        with open(path, "rb") as f:
            if _read(f, 4) != b"GGUF":
                raise ValueError("not a GGUF file (wrong magic bytes)")
            version, _tensors, fields = struct.unpack("<IQQ", _read(f, 20))
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
            for _ in range(fields):
                key_len = struct.unpack("<Q", _read(f, 8))[0]
                key = _read(f, min(key_len, 1 << 16)).decode("utf-8", errors="replace")
                f.seek(key_len - min(key_len, 1 << 16), 1)
                vtype = struct.unpack("<I", _read(f, 4))[0]
                if key == _TEMPLATE_KEY and vtype == _GGUF_STRING:
                    size = struct.unpack("<Q", _read(f, 8))[0]
                    if size > _MAX_TEMPLATE_BYTES:
                        raise ValueError(f"its chat template is over {_MAX_TEMPLATE_BYTES} bytes")
                    return _read(f, size).decode("utf-8", errors="replace")
                _skip(f, vtype)
    except (OSError, ValueError, struct.error) as exc:
        raise ConfigError(f"cannot read the chat template of {path}: {exc}") from None
    return None


def read_model_template(model: str) -> tuple[Any, dict[str, str]]:
    """``(template, special_tokens)`` of the model at ``model``: a Hugging Face directory, a
    ``.gguf`` file or a template file (``.jinja`` or any other text file). ``template`` is
    what the model carries (text, or its named templates) or ``None``; ``ConfigError`` when
    ``model`` cannot be read."""
    path = Path(model).expanduser()
    if path.is_dir():
        return _from_directory(path)
    if not path.is_file():
        raise ConfigError(f"{model!r} is neither a model directory nor a file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return gguf_chat_template(path), {}
    if path.stat().st_size > _MAX_TEMPLATE_BYTES:
        raise ConfigError(f"{model!r} is over {_MAX_TEMPLATE_BYTES} bytes: not a chat template")
    return path.read_text(encoding="utf-8", errors="replace"), {}
