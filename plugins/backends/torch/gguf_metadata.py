"""The config and tokenizer transformers derives from a GGUF file's metadata, converted once and
cached on disk (``<cache-dir>/gguf-metadata/``), so a later start of the same file skips it.

Two costs are kept apart. transformers parses every metadata field when it reads a config,
the tokenizer's hundred thousand strings and merges included (seconds on a small machine), so
the config is read from a copy of the header without the tokenizer's arrays. The tokenizer
conversion itself is cached by the tokenizer's own fields (``tokenizers/<hash>``): the files of
one model in other quantizations, or other models of one family, convert it once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from typing import Any, Callable

from .gguf_config import OWN_CONFIGS
from .gguf_file import GGUFFile
from .loader import publish_dir, read_gguf

log = logging.getLogger("llmserve.backend.torch")

_METADATA_DIR = "gguf-metadata"
#: Part of every cache key: raised when the configs written here change, so no stale one is read
#: (2: the Qwen-VL and Qwen3.5 files' rotary sections).
_CONFIG_VERSION = 2


def _header_key(path: str, fields_end: int, names: list[str]) -> str:
    """sha256 of what transformers derives the config and tokenizer from: the metadata's bytes,
    the tensors' names (tied embeddings are read from them; their types and offsets are not
    read, so files that differ only in how their tensors are quantized share one entry), the
    transformers version that converts them and the version of the configs written here."""
    import transformers

    digest = hashlib.sha256(f"{transformers.__version__}\n{_CONFIG_VERSION}".encode())
    digest.update("\n".join(sorted(names)).encode())
    with open(path, "rb") as fh:
        remaining = fields_end
        while remaining > 0:
            chunk = fh.read(min(remaining, 1 << 20))
            if not chunk:
                break
            digest.update(chunk)
            remaining -= len(chunk)
    return digest.hexdigest()[:24]


def _tokenizer_key(header: GGUFFile) -> str:
    """sha256 of what the tokenizer conversion reads: the ``tokenizer.*`` fields' bytes, the
    architecture (it picks the tokenizer class) and the transformers version."""
    import transformers

    digest = hashlib.sha256(f"{transformers.__version__}\n{header.architecture}\n".encode())
    digest.update(header.field_bytes(lambda key: key.startswith("tokenizer.")))
    return digest.hexdigest()[:24]


def _misread(header: GGUFFile) -> Callable[[str], bool]:
    """The metadata keys transformers' GGUF reading fails on: it reads each
    ``gpt-oss.rope.scaling.*`` value from the key's length field and raises on the number
    (``gguf_config.config_from_header`` reads those keys itself)."""
    prefix = "gpt-oss.rope.scaling."
    if header.architecture == "gpt-oss":
        return lambda key: key.startswith(prefix)
    return lambda key: False


def _tokenizer_dir(path: str, header: GGUFFile, root: str, drop: Callable[[str], bool]) -> str:
    """The tokenizer converted from the file's fields, once per tokenizer. An architecture
    transformers' GGUF reading does not know (``gguf_config.OWN_CONFIGS``) is named as the one its
    tokenizer shares for the conversion (which reads the ``tokenizer.*`` fields only)."""
    target = os.path.join(root, "tokenizers", _tokenizer_key(header))
    if os.path.isfile(os.path.join(target, "tokenizer_config.json")):
        return target
    alias = OWN_CONFIGS[header.architecture][0] if header.architecture in OWN_CONFIGS else None
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, os.path.basename(path))
        # Without the keys transformers fails on (and the weights); under an alias, without the
        # architecture's own keys too (transformers reads a key by its prefix, whatever the file's
        # architecture says, and fails on one it knows in another form: Gemma 4's per-layer widths).
        own = f"{header.architecture}."
        header.header_copy(copy, lambda key: drop(key) or (alias is not None and (
            key == "general.architecture" or key.startswith(own))), {"general.architecture": alias} if alias else None)
        _, tokenizer = read_gguf(copy, None, "converting the GGUF tokenizer of")
    publish_dir(target, tokenizer.save_pretrained)
    return target


def _config(path: str, header: GGUFFile, drop: Callable[[str], bool]) -> Any:
    """transformers' config of the file, read from a copy of its header without the tokenizer's
    arrays (what transformers would take from them, the vocabulary size, is written as a field)."""
    from transformers import AutoConfig

    arrays = {key for key, value in header.fields.items()
              if key.startswith("tokenizer.") and (value is None or isinstance(value, tuple))}
    extra: dict[str, int] = {}
    vocab_key = f"{header.architecture}.vocab_size"
    if vocab_key not in header.fields and "token_embd.weight" in header.tensors:
        extra[vocab_key] = int(header.tensors["token_embd.weight"].shape[-1])
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, os.path.basename(path))
        header.header_copy(copy, lambda key: drop(key) or key in arrays, extra)
        config, _ = read_gguf(copy, AutoConfig, "reading the GGUF metadata of", tokenizer=False)
    return config


def metadata_dir(path: str, header: GGUFFile, cache_dir: str | None) -> str:
    """A directory with the config and tokenizer transformers derives from the GGUF metadata
    (``header``: the file's), converted on first use and cached under ``cache_dir`` by the
    header's content."""
    root = os.path.join(os.path.expanduser(cache_dir or "~/.cache/llmserve"), _METADATA_DIR)
    target = os.path.join(root, _header_key(path, header.fields_end, list(header.tensors)))
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    log.info("reading the GGUF metadata and tokenizer of %s once (later starts read the cache %s)",
             os.path.basename(path), target)
    drop = _misread(header)
    tokenizer = _tokenizer_dir(path, header, root, drop)
    own = OWN_CONFIGS.get(header.architecture)
    config = own[1](header) if own is not None else _config(path, header, drop)

    def write(tmp: str) -> None:
        config.save_pretrained(tmp)
        shutil.copytree(tokenizer, tmp, dirs_exist_ok=True)

    publish_dir(target, write)
    return target
