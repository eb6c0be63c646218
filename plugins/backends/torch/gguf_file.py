"""A lean reader of a GGUF file's header: the scalar metadata and the tensor table, with every
tensor's bytes as a view of one read-only memory map of the file (of its part, for a model split
into several files).

``gguf.GGUFReader`` parses every metadata array into numpy views (a tokenizer's hundred thousand
strings and merges take seconds); serving needs none of them, since transformers converts the
tokenizer once and the result is cached. Arrays are skipped here, not decoded.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

# GGUF metadata value types: struct format of the fixed-size ones.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_SMALL_ARRAY = 1024  # numeric arrays up to this long are read (per-layer values); longer ones (a tokenizer's) are not
_DEFAULT_ALIGNMENT = 32


@dataclass
class TensorInfo:
    """One tensor of the table: ``shape`` as GGUF lists it (fastest-moving dimension first)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: int
    data: np.ndarray  # its bytes, uint8, a view of the file's mapping (read-only)


class GGUFHeaderError(ValueError):
    """The file is not a GGUF this reader understands."""


_SPLIT = re.compile(r"(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf", re.IGNORECASE)


def split_parts(path: str, count: int) -> list[str]:
    """The files of a split GGUF model (``name-00001-of-00003.gguf`` ...) whose first part is
    ``path`` and whose metadata says it has ``count`` parts; a missing part is an error."""
    folder, name = os.path.split(path)
    match = _SPLIT.fullmatch(name)
    if match is None or int(match.group("part")) != 1:
        raise GGUFHeaderError(f"{path} is part of a split GGUF model ({count} parts): serve its first part, the "
                              "file named ...-00001-of-%05d.gguf" % count)
    width = len(match.group("count"))
    parts = [os.path.join(folder, f"{match.group('stem')}-{i:0{width}d}-of-{count:0{width}d}.gguf")
             for i in range(1, count + 1)]
    missing = [os.path.basename(p) for p in parts if not os.path.isfile(p)]
    if missing:
        raise GGUFHeaderError(f"split GGUF model {name} misses {len(missing)} of its {count} parts "
                              f"({', '.join(missing[:3])}); put every part in {folder or '.'}")
    return parts


class _Cursor:
    """Reads a GGUF header's values from ``buf`` at ``pos``, moving past each."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, vtype: int) -> Any:
        """A field's value: a scalar, a string, a short array of numbers as a tuple (a value per
        layer); None for other arrays (a tokenizer's), which are skipped."""
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise GGUFHeaderError(f"unknown GGUF metadata type {vtype}")
        item, count = self.take("<I"), self.take("<Q")
        if item in _SCALARS and count <= _SMALL_ARRAY:
            return tuple(self.take(_SCALARS[item]) for _ in range(count))
        if item in _SCALARS:
            self.pos += struct.calcsize(_SCALARS[item]) * count
        elif item == _STRING:  # a vocabulary: skipped without decoding
            for _ in range(count):
                n = self.take("<Q")  # read before pos is: ``pos += take(...)`` would lose take's advance
                self.pos += n
        else:
            for _ in range(count):
                self.value(item)  # nested arrays, read and dropped
        return None


class GGUFFile:
    """``fields`` (scalars, strings and short numeric arrays as tuples; other arrays map to None),
    ``tensors`` by name,
    ``data_offset`` (where tensor data starts), ``fields_end`` (where the metadata ends) and
    ``architecture``.

    A split model (``split.count`` > 1, as llama.cpp's gguf-split writes it) is opened through its
    first part: the metadata is the first part's, and ``tensors`` holds every part's tensors, each
    a view of its own part's mapping; ``parts`` lists the files."""

    def __init__(self, path: str, _part: int = 0) -> None:
        self.path = path
        self._parse(path)
        count = int(self.fields.get("split.count") or 1)
        if _part or count <= 1:
            self.parts = [path]
            return
        if int(self.fields.get("split.no") or 0) != 0:
            raise GGUFHeaderError(f"{path} is not the first part of its split GGUF model: serve the file named "
                                  "...-00001-of-%05d.gguf" % count)
        self.parts = split_parts(path, count)
        for number, part in enumerate(self.parts[1:], 1):
            other = GGUFFile(part, _part=number)
            clash = set(other.tensors) & set(self.tensors)
            if clash:
                raise GGUFHeaderError(f"split GGUF part {part} repeats tensor {sorted(clash)[0]}")
            self.tensors.update(other.tensors)

    def _parse(self, path: str) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        raw = np.memmap(path, dtype=np.uint8, mode="r")
        buf = memoryview(raw)  # type: ignore[arg-type]
        c = _Cursor(buf)
        take, string = c.take, c.string

        try:
            if bytes(buf[:4]) != b"GGUF":
                raise GGUFHeaderError(f"{path} is not a GGUF file (wrong magic bytes)")
            c.pos = 4
            version = take("<I")
            if version not in (2, 3):
                raise GGUFHeaderError(f"GGUF version {version} is not supported (2 and 3 are)")
            n_tensors, n_fields = take("<Q"), take("<Q")
            self.version = version
            self.fields: dict[str, Any] = {}
            self._spans: list[tuple[str, int, int]] = []  # each field's key and bytes, for header_copy
            for _ in range(n_fields):
                start = c.pos
                key = string()
                self.fields[key] = c.value(take("<I"))
                self._spans.append((key, start, c.pos))
            self.fields_end = c.pos  # where the metadata ends and the tensor table begins
            table = []
            for _ in range(n_tensors):
                name, ndims = string(), take("<I")
                shape = tuple(take("<Q") for _ in range(ndims))
                table.append((name, shape, take("<I"), take("<Q")))
        except struct.error:
            raise GGUFHeaderError(f"{path} is truncated: its GGUF header ends early") from None
        align = int(self.fields.get("general.alignment") or _DEFAULT_ALIGNMENT)
        self.data_offset = -(-c.pos // align) * align
        self.architecture = str(self.fields.get("general.architecture") or "")
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, ttype, offset in table:
            try:
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
            except (ValueError, KeyError):
                block, size = 0, 0  # an unknown type: refused by the caller, by name
            count = int(np.prod(shape)) if shape else 1
            nbytes = count // block * size if block else 0
            start = self.data_offset + offset
            if start + nbytes > raw.shape[0]:
                raise GGUFHeaderError(f"{path} is truncated: tensor {name} ends past the end of the file")
            self.tensors[name] = TensorInfo(name, shape, ttype, raw[start:start + nbytes])
        self._raw = raw

    def field_bytes(self, pick: Callable[[str], bool]) -> bytes:
        """The stored bytes (key, type and value) of the metadata fields ``pick`` selects, in order."""
        return b"".join(self._raw[a:b].tobytes() for key, a, b in self._spans if pick(key))

    def header_copy(self, dest: str, drop: Callable[[str], bool], extra: dict[str, int | str] | None = None) -> None:
        """Write to ``dest`` a GGUF file with this one's metadata, less the keys ``drop`` picks and
        the split keys, plus ``extra`` fields (uint32 or string), and every tensor's name as a
        one-value F32 tensor: the header a reader of metadata sees, without the weights (a few MB
        at most)."""
        kept = [(a, b) for key, a, b in self._spans if not (drop(key) or key.startswith("split."))]
        added = [struct.pack("<Q", len(k.encode())) + k.encode() + (
            struct.pack("<IQ", _STRING, len(v.encode())) + v.encode() if isinstance(v, str)
            else struct.pack("<II", 4, v))  # 4: uint32
            for k, v in (extra or {}).items()]
        align = int(self.fields.get("general.alignment") or _DEFAULT_ALIGNMENT)
        out = bytearray(b"GGUF" + struct.pack("<IQQ", self.version, len(self.tensors), len(kept) + len(added)))
        for a, b in kept:
            out += self._raw[a:b].tobytes()
        for field in added:
            out += field
        for i, name in enumerate(self.tensors):
            encoded = name.encode("utf-8")
            out += struct.pack("<Q", len(encoded)) + encoded + struct.pack("<IQIQ", 1, 1, 0, i * align)
        out += bytes(-len(out) % align + len(self.tensors) * align)
        with open(dest, "wb") as fh:
            fh.write(out)
