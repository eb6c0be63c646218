"""KServe v2 tensors: JSON ``data`` and the binary tensor extension (what tritonclient sends by default).

A binary request is the JSON header (its length in the ``Inference-Header-Content-Length``
header) followed by each binary input's raw bytes, in input order; an input says how many
bytes are its own with ``parameters.binary_data_size``. Numbers are little-endian and
row-major, BOOL is one byte, and BYTES elements are a 4-byte little-endian length followed by
the bytes. Replies use the same layout for outputs asked for in binary.
"""

from __future__ import annotations

import math
import struct
import zlib
from typing import Any

from llmserve import InvalidRequestError, PayloadTooLargeError

from llmserve import UnsupportedError, load_json

# datatype -> struct code (BYTES is length-prefixed; BF16 has no struct code)
STRUCT_CODES = {"BOOL": "?", "UINT8": "B", "UINT16": "H", "UINT32": "I", "UINT64": "Q", "INT8": "b",
                "INT16": "h", "INT32": "i", "INT64": "q", "FP16": "e", "FP32": "f", "FP64": "d"}
DATATYPES = set(STRUCT_CODES) | {"BYTES", "BF16"}
INT_TYPES = {"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"}
_INT_RANGES = {t: ((0, 2 ** (8 * struct.calcsize(STRUCT_CODES[t])) - 1) if t.startswith("U")
                   else (-(2 ** (8 * struct.calcsize(STRUCT_CODES[t]) - 1)),
                         2 ** (8 * struct.calcsize(STRUCT_CODES[t]) - 1) - 1)) for t in INT_TYPES}


def decompress(raw: bytes, encoding: str | None, limit: int | None = None) -> bytes:
    """Undo the request ``Content-Encoding`` tritonclient may apply (gzip or deflate).

    ``limit`` caps the inflated size (a small compressed body can expand to gigabytes):
    beyond it the request is refused with 413.
    """
    if not encoding or encoding.strip().lower() in ("identity", ""):
        return raw
    enc = encoding.strip().lower()
    if enc not in ("gzip", "deflate"):
        raise UnsupportedError(f"unsupported Content-Encoding '{encoding}' (use gzip or deflate)")
    # wbits: 16+ for a gzip wrapper, plain for zlib's deflate stream.
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS if enc == "gzip" else zlib.MAX_WBITS)
    cap = limit if limit is not None else -1
    try:
        out = inflater.decompress(raw, cap + 1 if cap >= 0 else 0)
        if cap >= 0 and (len(out) > cap or inflater.unconsumed_tail):
            raise PayloadTooLargeError(f"request body inflates to more than {cap} bytes")
        out += inflater.flush()
        if not inflater.eof:
            raise InvalidRequestError(f"request body is not valid {enc} data (truncated)")
    except zlib.error:
        raise InvalidRequestError(f"request body is not valid {enc} data") from None
    return out


def split_body(raw: bytes, header_length: str | None) -> tuple[Any, bytes]:
    """(parsed JSON header, trailing binary data)."""
    if header_length is None:
        return load_json(raw), b""
    try:
        n = int(header_length)
    except ValueError:
        n = -1
    if not 0 <= n <= len(raw):
        raise InvalidRequestError(f"Inference-Header-Content-Length {header_length!r} is not a length within the "
                                  f"{len(raw)}-byte request body")
    return load_json(raw[:n]), raw[n:]


def element_count(shape: list[int]) -> int:
    return math.prod(shape) if shape else 1


def _flatten(data: Any) -> list[Any]:
    """Row-major values of nested lists (iterative: nesting depth is the client's choice)."""
    out: list[Any] = []
    stack = [iter([data])]
    while stack:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
        elif isinstance(item, list):
            stack.append(iter(item))
        else:
            out.append(item)
    return out


_END = object()


def decode_binary(datatype: str, chunk: bytes, name: str) -> list[Any]:
    """Raw tensor bytes -> flat list (BYTES elements as ``bytes``)."""
    if datatype == "BYTES":
        out, pos = [], 0
        while pos < len(chunk):
            if pos + 4 > len(chunk):
                raise InvalidRequestError(f"input '{name}': BYTES data is truncated (an element length needs 4 bytes)")
            (size,) = struct.unpack_from("<I", chunk, pos)
            pos += 4
            if pos + size > len(chunk):
                raise InvalidRequestError(f"input '{name}': BYTES element of {size} bytes runs past the end of "
                                          f"its data")
            out.append(bytes(chunk[pos:pos + size]))
            pos += size
        return out
    code = STRUCT_CODES.get(datatype)
    if code is None:
        raise UnsupportedError(f"input '{name}': datatype {datatype} is not supported by this server")
    width = struct.calcsize(code)
    if len(chunk) % width:
        raise InvalidRequestError(f"input '{name}': {len(chunk)} bytes is not a whole number of {datatype} "
                                  f"elements ({width} bytes each)")
    return list(struct.unpack(f"<{len(chunk) // width}{code}", chunk))


def decode_json(datatype: str, data: Any, name: str) -> list[Any]:
    """JSON ``data`` (flat or nested) -> flat list, type-checked (BYTES elements as ``bytes``)."""
    values = _flatten(data)
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in values):
            raise InvalidRequestError(f"input '{name}': BYTES data must be JSON strings")
        return [v.encode("utf-8") for v in values]
    if datatype in INT_TYPES:
        lo, hi = _INT_RANGES[datatype]
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int):
                raise InvalidRequestError(f"input '{name}': {datatype} data must be integers, got {v!r}")
            if not lo <= v <= hi:
                raise InvalidRequestError(f"input '{name}': {v} is out of range for {datatype}")
        return values
    if datatype == "BOOL":
        if not all(isinstance(v, bool) for v in values):
            raise InvalidRequestError(f"input '{name}': BOOL data must be true/false")
        return values
    if datatype in ("FP16", "FP32", "FP64"):
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise InvalidRequestError(f"input '{name}': {datatype} data must be numbers")
        return values
    raise UnsupportedError(f"input '{name}': datatype {datatype} is not supported in JSON")


def read_inputs(inputs: list[Any], binary: bytes) -> list[list[Any]]:
    """Each input's flat values, taking binary inputs' bytes from ``binary`` in order."""
    out: list[list[Any]] = []
    pos = 0
    for tensor in inputs:
        name, datatype = tensor.name, tensor.datatype
        if datatype not in DATATYPES:
            raise InvalidRequestError(f"input '{name}': unknown datatype '{datatype}'")
        params = tensor.parameters or {}
        if "shared_memory_region" in params:
            raise UnsupportedError(f"input '{name}': shared-memory tensors are not supported by this server")
        size = params.get("binary_data_size")
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise InvalidRequestError(f"input '{name}': parameters.binary_data_size must be a non-negative integer")
            if pos + size > len(binary):
                raise InvalidRequestError(f"input '{name}': binary_data_size {size} runs past the end of the request "
                                          f"body ({len(binary) - pos} bytes left)")
            values = decode_binary(datatype, binary[pos:pos + size], name)
            pos += size
        elif tensor.data is not None:
            values = decode_json(datatype, tensor.data, name)
        else:
            raise InvalidRequestError(f"input '{name}': no data (give `data` or parameters.binary_data_size)")
        count = element_count(tensor.shape)
        if len(values) != count:
            raise InvalidRequestError(f"input '{name}': shape {tensor.shape} holds {count} elements but "
                                      f"{len(values)} were given")
        out.append(values)
    if pos != len(binary):
        raise InvalidRequestError(f"the request body has {len(binary) - pos} bytes of binary data that no input "
                                  f"claims (check parameters.binary_data_size)")
    return out


def encode_binary(datatype: str, values: list[Any]) -> bytes:
    if datatype == "BYTES":
        return b"".join(struct.pack("<I", len(v)) + v for v in values)
    return struct.pack(f"<{len(values)}{STRUCT_CODES[datatype]}", *values)
