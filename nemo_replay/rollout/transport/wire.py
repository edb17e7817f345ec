"""Wire codec for large token-aligned arrays inside JSON bodies (docs/design.md §7).

An array travels as an envelope object ``{"data": <base64>, "shape": [...], "dtype": <name>}``:
the raw little-endian bytes of the C-contiguous array, base64-encoded (RFC 4648, with
padding), its shape, and a dtype name from :data:`WIRE_DTYPES` (anything else is refused).

:func:`dumps` writes compact JSON (no spaces, envelope keys in the order above).
:func:`loads` reads a body in two passes:

1. **Fast path.** It scans the raw bytes for compact envelopes, decodes each base64 run
   straight from a ``memoryview`` of the body into the array's final buffer, in 4 MiB
   chunks, and replaces the envelope with a small marker object. No Python ``str`` of the
   base64 is ever built; peak extra memory is the decoded array plus one chunk. The JSON
   left over (the small part) goes to ``json.loads``.
2. **Fallback.** Envelopes the scan did not recognise -- a proxy pretty-printed the body or
   re-ordered keys -- arrive as ordinary JSON objects and are decoded from their strings.
   Slower and heavier, never a crash.

Why the scan is safe: inside a JSON string every ``"`` is escaped, so the unescaped byte
sequence ``{"data":"`` can only open a real object, and base64 never contains ``"``.

Reserved syntax. An object holding all three keys ``data``, ``shape`` and ``dtype`` *is* an
envelope: :func:`dumps` refuses user objects of that shape (a :class:`WireError` naming
where), so every body it writes reads back unchanged. The marker objects that stand in for
arrays while the small JSON is parsed carry a random key chosen per call and absent from
the body (``"\u0000wire:<16 hex digits>"``), so no user object -- whatever its keys -- is
ever taken for one.

Worked example. ``dumps({"ids": torch.tensor([1, 2], dtype=torch.int32), "n": 2})`` gives

    {"ids":{"data":"AQAAAAIAAAA=","shape":[2],"dtype":"int32"},"n":2}

``loads`` finds ``{"data":"`` at byte 7, the closing quote after ``AQAAAAIAAAA=``, matches the
``","shape":[2],"dtype":"int32"}`` tail, decodes 8 bytes into an int32 buffer of 2, and parses
``{"ids":{"\\u0000wire:<nonce>":0},"n":2}`` with ``json.loads``.

Every malformed payload -- truncated body, base64 that is not base64 or whose length does
not match ``shape`` x ``dtype``, a dtype off the allow-list, a bad shape, a bool byte other
than 0/1, JSON nested too deeply to parse -- raises :class:`WireError`, a ``ValueError``.

Integer checks on decoded data widen to int64 first: a ``uint8`` array compared with ``-1``
would compare with 255 (torch casts the scalar to the array's dtype).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import secrets
import sys
from typing import Any, Optional, Union

import numpy as np
import torch

from nemo_replay.rollout.boundary import validate_support
from nemo_replay.support.codec import decode_support, encode_support
from nemo_replay.support.dtypes import is_integer
from nemo_replay.support.packed import PackedTensor
from nemo_replay.support.ragged import RaggedSupport, is_support

__all__ = [
    "WIRE_DTYPES",
    "CODEC_TAG",
    "WireError",
    "dumps",
    "loads",
    "encode_array",
    "decode_envelope",
    "support_to_wire",
    "support_from_wire",
    "routes_from_wire",
]

#: Allowed dtype names and their torch dtypes (little-endian on the wire).
WIRE_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
_NAMES = {v: k for k, v in WIRE_DTYPES.items()}
ENVELOPE_KEYS = frozenset(("data", "shape", "dtype"))
_MARKER_KEY = "\x00wire:"  # + a per-call nonce; written by json as "\u0000wire:<nonce>"
_MARKER_JSON = b'"\\u0000wire:'
_PREFIX = b'{"data":"'
_TAIL = re.compile(rb'","shape":\[((?:\d+(?:,\d+)*)?)\],"dtype":"([A-Za-z0-9_]{1,16})"\}')
_CHUNK = 4 << 20  # base64 characters decoded per step (a multiple of 4)
_MAX_DIMS = 8

assert sys.byteorder == "little", "the wire format is little-endian; big-endian hosts are not supported"


class WireError(ValueError):
    """A malformed wire body: truncated, corrupted, or not the expected shape/dtype."""


# ---------------------------------------------------------------------------------- encode


def encode_array(array: Union[torch.Tensor, np.ndarray]) -> bytes:
    """One compact envelope, as bytes.

    Args:
        array: any shape, a dtype from :data:`WIRE_DTYPES` (a numpy array is converted).
    """
    raw, shape, name = array_bytes(array)
    return b"".join(
        (_PREFIX, base64.b64encode(memoryview(raw)), b'","shape":[', ",".join(map(str, shape)).encode(), b'],"dtype":"',
         name.encode(), b'"}')
    )


def array_bytes(array: Union[torch.Tensor, np.ndarray]) -> tuple[np.ndarray, list[int], str]:
    """An array's raw little-endian bytes (C order, a uint8 view), its shape and its dtype name.

    Args:
        array: any shape, a dtype from :data:`WIRE_DTYPES` (a numpy array is converted).
    """
    if not isinstance(array, (torch.Tensor, np.ndarray)):
        raise WireError(f"wire encode: expected a tensor or numpy array, got {type(array).__name__}")
    t = torch.from_numpy(np.ascontiguousarray(array)) if isinstance(array, np.ndarray) else array
    if t.dtype not in _NAMES:
        raise WireError(f"wire encode: dtype {t.dtype} is not on the allow-list {sorted(WIRE_DTYPES)}")
    shape = [int(s) for s in t.shape]
    t = t.detach().cpu().contiguous().reshape(-1)
    raw = t.view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
    return raw, shape, _NAMES[t.dtype]


def _nonce(avoid: bytes = b"") -> str:
    """16 random hex digits that do not occur in ``avoid``."""
    while True:
        nonce = secrets.token_hex(8)
        if nonce.encode() not in avoid:
            return nonce


def _marker(nonce: str, i: int) -> bytes:
    return b'{"\\u0000wire:%s":%d}' % (nonce.encode(), i)


def refuse_envelope_shaped(obj: Any, path: str) -> None:
    """User objects holding data/shape/dtype would read back as arrays: refuse them."""
    if isinstance(obj, dict):
        if ENVELOPE_KEYS <= obj.keys():
            raise WireError(
                f"wire encode at {path}: an object with the keys {sorted(ENVELOPE_KEYS)} is the wire's array envelope; "
                f"pass the array itself (a tensor or numpy array) or rename one of the keys"
            )
        for k, v in obj.items():
            refuse_envelope_shaped(v, f"{path}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            refuse_envelope_shaped(v, f"{path}[{i}]")


def dumps(obj: Any) -> bytes:
    """Compact JSON bytes; every tensor / numpy array inside ``obj`` becomes an envelope.

    Raises:
        WireError: ``obj`` holds an object with the reserved keys (module doc), a dtype off
            the allow-list, or a value JSON cannot hold.
    """
    refuse_envelope_shaped(obj, "$")
    while True:
        nonce, arrays = _nonce(), []

        def placeholder(o):
            if isinstance(o, (torch.Tensor, np.ndarray)):
                arrays.append(o)
                return {_MARKER_KEY + nonce: len(arrays) - 1}
            raise TypeError(f"wire encode: {type(o).__name__} is not JSON serialisable")

        text = json.dumps(obj, separators=(",", ":"), default=placeholder, allow_nan=False).encode()
        if text.count(_MARKER_JSON + nonce.encode()) == len(arrays):
            break  # else the user's data holds this nonce's key: draw another
    if not arrays:
        return text
    pieces, last = [], 0
    for i, arr in enumerate(arrays):
        m = _marker(nonce, i)
        at = text.index(m, last)
        pieces += [text[last:at], encode_array(arr)]
        last = at + len(m)
    pieces.append(text[last:])
    return b"".join(pieces)


# ---------------------------------------------------------------------------------- decode


_MAX_DIM = 2**31 - 1
_LONG_INT = "wire decode: the body holds an integer of more than 4300 digits; no field of this wire takes one"


def check_header(shape: Any, dtype: Any, where: str) -> tuple[tuple[int, ...], torch.dtype]:
    if not isinstance(dtype, str) or dtype not in WIRE_DTYPES:
        raise WireError(f"{where}: dtype {dtype!r} is not on the allow-list {sorted(WIRE_DTYPES)}")
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_DIMS
        or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in shape)
    ):
        raise WireError(f"{where}: shape {shape!r} must be a list of at most {_MAX_DIMS} non-negative ints")
    if any(s > _MAX_DIM for s in shape):
        # A dimension this long needs more bytes than any body may hold (an empty array's other
        # dimensions included: no array of this wire is that wide).
        raise WireError(f"{where}: shape {shape!r} has a dimension over {_MAX_DIM} (2**31 - 1); corrupted header")
    if math.prod(max(s, 1) for s in shape) > _MAX_DIM:
        # An empty array's strides are the product of its other dimensions: [0] + five of
        # 2**31 - 1 needs strides past int64 (torch: "Stride calculation overflowed").
        raise WireError(f"{where}: shape {shape!r} spans more than {_MAX_DIM} (2**31 - 1) elements with its zero "
                        f"dimensions taken as 1; corrupted header")
    return tuple(shape), WIRE_DTYPES[dtype]


def _decode_b64(b64: Union[memoryview, bytes, str], shape: tuple[int, ...], dtype: torch.dtype, where: str) -> torch.Tensor:
    """Decode base64 into a new tensor of ``shape``/``dtype``, chunk by chunk, in place."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    n = len(b64)
    if n % 4:
        raise WireError(f"{where}: base64 length {n} is not a multiple of 4 (truncated or corrupted payload)")
    tail = b64[-2:] if n else b""
    tail = tail.tobytes() if isinstance(tail, memoryview) else tail
    tail = tail.encode("ascii", "replace") if isinstance(tail, str) else tail
    pad = tail.count(b"=") if tail.endswith(b"=") else 0
    if n // 4 * 3 - pad != nbytes:
        raise WireError(
            f"{where}: payload holds {n // 4 * 3 - pad} bytes but shape {list(shape)} of {dtype} needs {nbytes}; "
            f"wrong shape or dtype, or a truncated payload"
        )
    out = torch.empty(nbytes, dtype=torch.uint8)
    view = out.numpy()
    at = 0
    try:
        for s in range(0, n, _CHUNK):
            chunk = binascii.a2b_base64(b64[s : s + _CHUNK], strict_mode=True)
            view[at : at + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
            at += len(chunk)
    except (binascii.Error, ValueError) as exc:
        raise WireError(f"{where}: payload is not valid base64 ({exc}); corrupted body") from None
    if at != nbytes:
        raise WireError(f"{where}: decoded {at} bytes, expected {nbytes}; corrupted payload")
    if dtype == torch.bool and bool((out > 1).any()):
        raise WireError(f"{where}: a bool payload holds bytes other than 0 and 1; corrupted payload")
    return out.view(dtype).reshape(shape)


def decode_envelope(obj: dict, *, where: str = "wire decode") -> torch.Tensor:
    """Decode an envelope already parsed by ``json`` (the fallback path)."""
    if not isinstance(obj, dict):
        raise WireError(f"{where}: expected an envelope object {{data, shape, dtype}}, got {type(obj).__name__}")
    shape, dtype = check_header(obj.get("shape"), obj.get("dtype"), where)
    data = obj.get("data")
    if not isinstance(data, str):
        raise WireError(f"{where}: envelope 'data' must be a base64 string, got {type(data).__name__}")
    if not data.isascii():
        raise WireError(f"{where}: envelope 'data' holds non-ASCII characters; corrupted payload")
    return _decode_b64(data, shape, dtype, where)


def _restore(node: Any, arrays: list, key: str, path: str) -> Any:
    """Swap markers (the one-item objects under ``key``) and fallback envelopes for tensors."""
    if isinstance(node, dict):
        if len(node) == 1 and key in node:
            return arrays[node[key]]
        if ENVELOPE_KEYS <= node.keys():
            if node.keys() != ENVELOPE_KEYS:
                extra = sorted(set(node) - ENVELOPE_KEYS)
                raise WireError(f"wire decode at {path}: envelope with unexpected keys {extra}")
            return decode_envelope(node, where=f"wire decode at {path}")
        return {k: _restore(v, arrays, key, f"{path}.{k}") for k, v in node.items()}
    if isinstance(node, list):
        return [_restore(v, arrays, key, f"{path}[{i}]") for i, v in enumerate(node)]
    return node


def parse_json(text: Union[bytes, bytearray, str], what: str) -> Any:
    """``json.loads`` with every failure a :class:`WireError` naming ``what`` ("body", "head")."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise WireError(f"wire decode: {what} is not valid JSON ({exc.msg} at char {exc.pos}); truncated or corrupted") from None
    except UnicodeDecodeError:
        raise WireError(f"wire decode: {what} is not UTF-8 text; corrupted") from None
    except RecursionError:
        raise WireError(f"wire decode: {what} is JSON nested too deeply to parse; refused") from None
    except ValueError:  # Python's cap on integer digits (4300)
        raise WireError(_LONG_INT.replace("the body", f"the {what}")) from None


def loads(raw: Union[bytes, bytearray, memoryview]) -> Any:
    """Parse a body written by :func:`dumps` (or reformatted in transit); envelopes -> tensors.

    Args:
        raw: the body bytes, as read from the socket.

    Returns:
        The JSON value with every envelope replaced by a CPU tensor of its shape and dtype.

    Raises:
        WireError (a ValueError) for truncated or corrupted bodies and bad envelopes.
    """
    if isinstance(raw, memoryview):
        raw = raw.tobytes()
    if not isinstance(raw, (bytes, bytearray)):
        raise WireError(f"wire decode: expected the raw body bytes, got {type(raw).__name__}")
    mv = memoryview(raw)
    nonce = _nonce(avoid=raw)  # absent from the body: no user object can carry the marker key
    pieces: list = []
    arrays: list = []
    last = pos = 0
    while True:
        i = raw.find(_PREFIX, pos)
        if i < 0:
            break
        start = i + len(_PREFIX)
        j = raw.find(b'"', start)
        if j < 0:
            raise WireError(f"wire decode: the envelope at byte {i} never closes its base64 string; truncated body")
        m = _TAIL.match(raw, j)
        if m is None:  # not the compact layout: leave it to the fallback
            pos = start
            continue
        shape_txt = m.group(1).decode()
        where = f"wire decode, envelope at byte {i}"
        try:
            shape = [int(s) for s in shape_txt.split(",")] if shape_txt else []
        except ValueError:
            raise WireError(f"{where}: {_LONG_INT}") from None
        shape_t, dtype = check_header(shape, m.group(2).decode(), where)
        arrays.append(_decode_b64(mv[start:j], shape_t, dtype, where))
        pieces += [mv[last:i], _marker(nonce, len(arrays) - 1)]
        last = pos = m.end()
    pieces.append(mv[last:])
    obj = parse_json(b"".join(pieces) if arrays else raw, "body")
    try:
        return _restore(obj, arrays, _MARKER_KEY + nonce, "$")
    except RecursionError:
        raise WireError("wire decode: body is JSON nested too deeply to parse; refused") from None


# ---------------------------------------------------------------------------------- schema


#: The wire tag of :mod:`nemo_replay.support.codec`'s buffers (``{"codec": CODEC_TAG, "data": <uint8>}``).
CODEC_TAG = "nrsc-1"


def support_to_wire(
    support: Union[PackedTensor, RaggedSupport, torch.Tensor],
    *,
    vocab_size: Optional[int] = None,
    sampled_ids: Optional[torch.Tensor] = None,
) -> dict:
    """The support of one response as a wire object.

    With ``vocab_size``, the compact form: ``{"codec": "nrsc-1", "data": <envelope uint8>}``,
    one :func:`~nemo_replay.support.codec.encode_support` buffer (the sampled ids dropped when
    ``sampled_ids`` is given: the response carries them). Without, the older forms every reader
    still takes: fixed-width rows (``[n, k]`` int32, bare or a one-segment PackedTensor) become
    ``{"rows": <envelope>}``; CSR rows (a one-segment RaggedSupport) become
    ``{"member_ids": <envelope int32>, "row_offsets": <envelope int64>}``.
    """
    if vocab_size is not None:
        if isinstance(support, torch.Tensor):
            support = PackedTensor(support, [0, support.shape[0]])
        if not is_support(support) or support.batch_size != 1:
            raise WireError("wire encode: send one response's support at a time (a one-segment PackedTensor or RaggedSupport)")
        data = encode_support(support, vocab_size=vocab_size, sampled_ids=sampled_ids)
        return {"codec": CODEC_TAG, "data": torch.from_numpy(data)}
    if getattr(support, "csr", False):
        if support.batch_size != 1:
            raise WireError(f"wire encode: send one response's support at a time, got {support.batch_size} segments")
        return {"member_ids": support.member_ids.to(torch.int32), "row_offsets": support.row_offsets.to(torch.int64)}
    if isinstance(support, PackedTensor):
        if support.batch_size != 1:
            raise WireError(f"wire encode: send one response's support at a time, got {support.batch_size} segments")
        support = support.values
    if not isinstance(support, torch.Tensor) or support.dim() != 2:
        got = f"a {support.dim()}-D tensor" if isinstance(support, torch.Tensor) else type(support).__name__
        raise WireError(f"wire encode: support must be a PackedTensor, a RaggedSupport or int [n, k] rows, got {got}")
    return {"rows": support.to(torch.int32)}


def _integer(t: Any, dims: int, name: str, where: str) -> torch.Tensor:
    """``t`` checked as an integer array of ``dims`` dimensions, returned widened to int64.

    Widening first matters: comparisons of a uint8 array with a negative number wrap it.
    """
    if not isinstance(t, torch.Tensor):
        raise WireError(f"{where}: '{name}' must be an array envelope, got {type(t).__name__}")
    if not is_integer(t):
        raise WireError(f"{where}: '{name}' must hold integers, got dtype {t.dtype}")
    if t.dim() != dims:
        raise WireError(f"{where}: '{name}' must be {dims}-D, got shape {list(t.shape)}")
    return t.to(torch.int64)


def _in_range(t: torch.Tensor, lo: int, hi: int, name: str, where: str) -> None:
    """Every value of the int64 tensor ``t`` in ``[lo, hi]``."""
    if t.numel() and (int(t.min()) < lo or int(t.max()) > hi):
        bad = int(t[(t < lo) | (t > hi)][0])
        top = "2**31" if hi == _INT32_MAX else str(hi + 1)
        raise WireError(f"{where}: '{name}' hold {bad}, outside [{lo}, {top})")


_INT32_MAX = torch.iinfo(torch.int32).max


def support_from_wire(
    obj: Any,
    *,
    sampled_ids: Optional[torch.Tensor] = None,
    vocab_size: Optional[int] = None,
    where: str = "wire decode: support",
) -> Union[PackedTensor, RaggedSupport]:
    """Read :func:`support_to_wire`'s object back and check it (docs/design.md §2 boundary).

    Args:
        obj: the decoded object (envelopes already tensors, as :func:`loads` returns).
        sampled_ids: (n,) the response's tokens; sets the expected row count and checks
            that each sampled token is a member of its row.
        vocab_size: ids must be below it when given.

    Returns:
        A one-segment ``PackedTensor`` (int32 [n, k]) or ``RaggedSupport`` (n rows).
    """
    if not isinstance(obj, dict):
        raise WireError(f"{where}: expected an object with 'rows' or 'member_ids'/'row_offsets', got {type(obj).__name__}")
    try:
        if "codec" in obj:
            if obj["codec"] != CODEC_TAG or set(obj) != {"codec", "data"}:
                raise WireError(f"{where}: a compact support is {{'codec': {CODEC_TAG!r}, 'data': <uint8 array>}}, got "
                                f"codec {obj.get('codec')!r} with keys {sorted(obj)}; upgrade the reader if the tag is newer")
            data = obj["data"]
            if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1:
                raise WireError(f"{where}: 'data' must be a 1-D uint8 array envelope")
            # The decoder establishes §2 (sorted in-range rows, sampled tokens members) and records it.
            try:
                support = decode_support(data, sampled_ids=sampled_ids, vocab_size=vocab_size)
            except ValueError as exc:
                raise WireError(f"{where}: {exc}") from None
            if support.batch_size != 1:
                raise WireError(f"{where}: a response's compact support holds {support.batch_size} segments, expected 1")
            return support
        elif "rows" in obj:
            rows = _integer(obj["rows"], 2, "rows", where)
            _in_range(rows, -1, _INT32_MAX, "rows", where)
            support: Union[PackedTensor, RaggedSupport] = PackedTensor(rows.to(torch.int32), [0, rows.shape[0]])
        elif "member_ids" in obj and "row_offsets" in obj:
            members = _integer(obj["member_ids"], 1, "member_ids", where)
            offsets = _integer(obj["row_offsets"], 1, "row_offsets", where)
            _in_range(members, 0, _INT32_MAX, "member_ids", where)
            if offsets.numel() == 0:
                raise WireError(f"{where}: 'row_offsets' must hold n + 1 entries, got none")
            segments = torch.tensor([0, offsets.numel() - 1], dtype=torch.int32)
            support = RaggedSupport(members.to(torch.int32), offsets, segments)
        else:
            raise WireError(f"{where}: expected keys 'rows' or 'member_ids' and 'row_offsets', got {sorted(obj)}")
        if sampled_ids is not None and torch.as_tensor(sampled_ids).shape != (support.num_rows,):
            raise WireError(
                f"{where}: {support.num_rows} support rows for {torch.as_tensor(sampled_ids).numel()} sampled "
                f"tokens; expected one each"
            )
        validate_support(support, sampled_ids=sampled_ids, vocab_size=vocab_size, where=where)
    except WireError:
        raise
    except ValueError as exc:
        raise WireError(str(exc)) from None
    return support


def routes_from_wire(obj: Any, *, where: str = "wire decode: routes") -> torch.Tensor:
    """Check a routes envelope: integer ``[tokens, layers, topk]``, expert ids >= -1.

    Returns the routes in the dtype they travelled in (``uint8`` routes stay ``uint8``);
    the check runs on an int64 copy.
    """
    wide = _integer(obj, 3, "routes", where)
    if wide.numel() and int(wide.min()) < -1:
        raise WireError(f"{where}: expert ids must be >= -1, got {int(wide.min())}")
    return obj
