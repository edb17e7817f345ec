"""Binary wire bodies: a JSON head, then the arrays' raw bytes (docs/transport.md, "The binary body").

A body of media type :data:`BINARY_TYPE` is laid out as::

    offset 0             b"NRW1"     magic and format version, 4 bytes
    offset 4             head_len    uint32, little-endian
    offset 8             head        head_len bytes of compact UTF-8 JSON
    offset 8 + head_len  part 0, part 1, ...   back to back, no padding, to the body's last byte

The head is the message as JSON with every array an envelope whose ``data`` is the index of
its part, ``{"data": 0, "shape": [n], "dtype": "int32"}`` -- the reserved syntax of
:mod:`~nemo_replay.rollout.transport.wire` (an object holding ``data``, ``shape`` and ``dtype``
is an envelope; the writer refuses user objects of that shape). Part ``i`` belongs to the
``i``-th envelope in the head's text order and holds the raw little-endian bytes of the
C-contiguous array, ``prod(shape) x itemsize`` of them: a part's length and offset follow from
the head and the parts before it, and the last part ends where the body ends.

Worked example. ``dumps_binary({"ids": torch.tensor([1, 2], dtype=torch.int32), "n": 2})``
is 68 bytes::

    4e 52 57 31                                               NRW1
    34 00 00 00                                               head_len = 52
    {"ids":{"data":0,"shape":[2],"dtype":"int32"},"n":2}      the head, 52 bytes (offsets 8-59)
    01 00 00 00 02 00 00 00                                   part 0: int32 [1, 2] (offsets 60-67)

Every malformed body raises :class:`~nemo_replay.rollout.transport.wire.WireError` (a
``ValueError``) naming the byte offset: fewer than 8 bytes, another magic, a head running past
the body's end, a head that is not UTF-8 JSON, an envelope naming a part out of order, a bad
shape or dtype (the JSON envelopes' checks), a part running past the body's end, bytes after
the last part, a bool part holding bytes other than 0 and 1. Another version of this format
(``NRW`` and another digit) is :class:`UnsupportedVersion`, which the server answers 415.
Each part is copied into its own tensor, so the body can be freed once it is decoded.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any, Optional, Union

import numpy as np
import torch

from nemo_replay.rollout.transport.wire import (
    ENVELOPE_KEYS,
    WireError,
    array_bytes,
    check_header,
    dumps,
    loads,
    parse_json,
    refuse_envelope_shaped,
)

__all__ = [
    "BINARY_TYPE",
    "JSON_TYPE",
    "MAGIC",
    "UnsupportedVersion",
    "accepts_binary",
    "dumps_binary",
    "loads_binary",
    "head_of",
    "dumps_body",
    "loads_body",
]

#: The media type of a binary body.
BINARY_TYPE = "application/vnd.nemo-replay.wire"
#: The media type of a JSON body (base64 envelopes).
JSON_TYPE = "application/json"
#: The first four bytes of a binary body: the format and its version.
MAGIC = b"NRW1"
_FIXED = struct.Struct("<4sI")  # magic, head_len


class UnsupportedVersion(WireError):
    """A binary body of another version of the format (its magic is ``NRW`` and another digit)."""


def dumps_binary(obj: Any) -> bytes:
    """A binary body: ``obj`` as the JSON head, every tensor / numpy array inside it a part.

    Raises:
        WireError: ``obj`` holds an object with the reserved envelope keys, a dtype off the
            allow-list, or a value JSON cannot hold.
    """
    refuse_envelope_shaped(obj, "$")
    parts: list[np.ndarray] = []

    def envelope(o):
        if isinstance(o, (torch.Tensor, np.ndarray)):
            raw, shape, name = array_bytes(o)
            parts.append(raw)
            return {"data": len(parts) - 1, "shape": shape, "dtype": name}
        raise WireError(f"wire encode: {type(o).__name__} is not JSON serialisable")

    head = json.dumps(obj, separators=(",", ":"), default=envelope, allow_nan=False).encode()
    return b"".join([_FIXED.pack(MAGIC, len(head)), head, *(memoryview(p) for p in parts)])


def head_of(raw: Union[bytes, bytearray, memoryview]) -> memoryview:
    """The head's bytes of a binary body, after checking the magic and that the head fits."""
    mv = memoryview(raw)
    if len(mv) < _FIXED.size:
        raise WireError(f"binary wire decode: the body holds {len(mv)} bytes, fewer than the 8 of its magic and head "
                        f"length; truncated body")
    magic, head_len = _FIXED.unpack_from(mv)
    if magic != MAGIC:
        if magic[:3] == MAGIC[:3]:
            raise UnsupportedVersion(f"binary wire decode: the body is format version {magic!r}, this reader takes "
                                     f"{MAGIC!r}; send {MAGIC!r} or a JSON body ({JSON_TYPE})")
        raise WireError(f"binary wire decode: the body starts with {magic!r}, not the magic {MAGIC!r}; send a body "
                        f"written by dumps_binary, or a JSON one as {JSON_TYPE}")
    if _FIXED.size + head_len > len(mv):
        raise WireError(f"binary wire decode: the head's length {head_len} at byte 4 runs past the body's end "
                        f"({len(mv)} bytes); truncated body or corrupted head length")
    return mv[_FIXED.size:_FIXED.size + head_len]


def loads_binary(raw: Union[bytes, bytearray, memoryview]) -> Any:
    """Parse a body written by :func:`dumps_binary`; envelopes -> CPU tensors.

    Args:
        raw: the body bytes, as read from the socket.

    Raises:
        WireError (a ValueError) for truncated or corrupted bodies and bad envelopes;
        UnsupportedVersion (a WireError) for another version of the format.
    """
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise WireError(f"binary wire decode: expected the raw body bytes, got {type(raw).__name__}")
    mv = memoryview(raw).cast("B")
    head = head_of(mv)
    try:
        text = bytes(head).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WireError(f"binary wire decode: the head is not UTF-8 (byte {_FIXED.size + exc.start}); corrupted head") from None
    obj = parse_json(text, "head")
    cursor = [0, _FIXED.size + head.nbytes]  # the next part's index and its byte offset
    try:
        out = _restore(obj, mv, cursor, "$")
    except RecursionError:
        raise WireError("binary wire decode: head is JSON nested too deeply to parse; refused") from None
    if cursor[1] != len(mv):
        raise WireError(f"binary wire decode: {len(mv) - cursor[1]} bytes follow the last part (it ends at byte "
                        f"{cursor[1]} of {len(mv)}); the head names fewer parts than the body holds: corrupted body")
    return out


def _restore(node: Any, mv: memoryview, cursor: list, path: str) -> Any:
    if isinstance(node, dict):
        if ENVELOPE_KEYS <= node.keys():
            return _part(node, mv, cursor, path)
        return {k: _restore(v, mv, cursor, f"{path}.{k}") for k, v in node.items()}
    if isinstance(node, list):
        return [_restore(v, mv, cursor, f"{path}[{i}]") for i, v in enumerate(node)]
    return node


def _part(node: dict, mv: memoryview, cursor: list, path: str) -> torch.Tensor:
    """The tensor of the envelope ``node``: the next part, checked against the body's length."""
    where = f"binary wire decode at {path}"
    if node.keys() != ENVELOPE_KEYS:
        raise WireError(f"{where}: envelope with unexpected keys {sorted(set(node) - ENVELOPE_KEYS)}")
    index, at = cursor
    data = node["data"]
    if isinstance(data, bool) or not isinstance(data, int) or data != index:
        raise WireError(f"{where}: the envelope's data is {data!r}, expected the part index {index}; parts follow the "
                        f"head in the order their envelopes appear (a base64 envelope belongs in a JSON body)")
    shape, dtype = check_header(node["shape"], node["dtype"], where)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if at + nbytes > len(mv):
        raise WireError(f"{where}: part {index} ({list(shape)} {node['dtype']}, {nbytes} bytes from byte {at}) runs "
                        f"past the body's end ({len(mv)} bytes); truncated body, or a head naming bytes that are not there")
    out = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        out.numpy()[:] = np.frombuffer(mv, dtype=np.uint8, count=nbytes, offset=at)
    if dtype == torch.bool and bool((out > 1).any()):
        raise WireError(f"{where}: bool part {index} holds bytes other than 0 and 1; corrupted body")
    cursor[:] = [index + 1, at + nbytes]
    return out.view(dtype).reshape(shape)


def accepts_binary(accept: Optional[str]) -> bool:
    """Whether an ``Accept`` header names :data:`BINARY_TYPE` with a quality above 0.

    Only the type named outright counts: ``*/*`` (an old client's default) gets JSON.
    """
    for item in (accept or "").split(","):
        media, *params = (p.strip() for p in item.split(";"))
        if media.lower() != BINARY_TYPE:
            continue
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    return float(value) > 0
                except ValueError:
                    return False
        return True
    return False


def dumps_body(obj: Any, binary: bool) -> tuple[bytes, str]:
    """``obj`` as a body of either form, and its media type."""
    return (dumps_binary(obj), BINARY_TYPE) if binary else (dumps(obj), JSON_TYPE)


def loads_body(raw: Union[bytes, bytearray, memoryview], content_type: Optional[str]) -> Any:
    """A body read by its media type: :data:`BINARY_TYPE` as binary, any other as JSON.

    A binary body labelled as something else is named, with the type to send instead.
    """
    if (content_type or "").lower() == BINARY_TYPE:
        return loads_binary(raw)
    if bytes(raw[:3]) == MAGIC[:3]:
        raise WireError(f"wire decode: the body is a binary wire body (it starts with {bytes(raw[:4])!r}) sent as "
                        f"{content_type!r}; label it Content-Type: {BINARY_TYPE}")
    return loads(raw)
