"""privfl's messages as bytes, exactly and checked: the one wire format between a client half and a server half.

A message is a mapping of names to values: numpy arrays (boolean, integer, unsigned, floating and complex dtypes,
any byte order and shape; the bits come back identical), Python ``bool``, ``int`` (any size), ``float`` (NaN and
infinities included), ``str``, ``bytes``, ``None``, lists and tuples of values and nested mappings with string keys.
numpy scalars are taken as the Python value they equal (``np.int64(3)`` comes back as ``3``).

The **envelope** (:func:`to_bytes`, :func:`from_bytes`) is::

    MAGIC (9 bytes) | version (uint16) | body length (uint64) | body | SHA-256(MAGIC, version, length, body)
    body = header length (uint64) | header (canonical JSON: the kind and the tree of values) | array bytes

so a message that was truncated, extended or changed in any bit is refused with :class:`CorruptMessage`, never
decoded to a wrong value. The digest detects accidents and tampering by anyone who cannot recompute it; it is not a
signature (authenticity between organisations is the transport's job: TLS and SuperNode authentication in Flower).

Flower's record form of the same messages is :mod:`privfl.flower.records`.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from privfl.errors import CorruptMessage, MessageError, UnsupportedValue

MAGIC = b"PRIVFLMSG"
VERSION = 1
_PREFIX = struct.Struct(">HQ")  # version, body length
_HEADER_LEN = struct.Struct(">Q")
_DIGEST = 32
#: dtype kinds carried bit-exactly: bool, signed and unsigned integers, floating, complex
_KINDS = "biufc"


# -- encoding -----------------------------------------------------------------------------------------------------

class _Encoder:
    def __init__(self) -> None:
        self.segments: list[bytes] = []
        self.offset = 0

    def _segment(self, data: bytes) -> dict:
        node = {"offset": self.offset, "nbytes": len(data)}
        self.segments.append(data)
        self.offset += len(data)
        return node

    def node(self, value: Any, path: str) -> dict:
        if isinstance(value, np.ndarray):
            dtype = value.dtype
            if dtype.kind not in _KINDS or dtype.fields is not None or dtype.subdtype is not None:
                raise UnsupportedValue(f"{path}: arrays of dtype {dtype} cannot be carried exactly; use a boolean, "
                                       f"integer, floating or complex dtype")
            node = self._segment(np.ascontiguousarray(value).tobytes())
            node.update(t="array", dtype=dtype.str, shape=[int(s) for s in value.shape])
            return node
        if isinstance(value, (bool, np.bool_)):
            return {"t": "bool", "v": bool(value)}
        if isinstance(value, (int, np.integer)):
            return {"t": "int", "v": int(value)}
        if isinstance(value, (float, np.floating)):
            return {"t": "float", "v": float(value).hex()}  # hex is exact for every double, inf and nan included
        if isinstance(value, str):
            return {"t": "str", "v": value}
        if isinstance(value, (bytes, bytearray)):
            node = self._segment(bytes(value))
            node["t"] = "bytes"
            return node
        if value is None:
            return {"t": "none"}
        if isinstance(value, (list, tuple)):
            return {"t": "list" if isinstance(value, list) else "tuple",
                    "v": [self.node(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, Mapping):
            items = []  # [key, node] pairs in the mapping's order (the arrays' bytes follow the same order)
            for key, v in value.items():
                if not isinstance(key, str):
                    raise UnsupportedValue(f"{path}: mapping keys must be strings, got {key!r}")
                items.append([key, self.node(v, f"{path}.{key}" if path else key)])
            return {"t": "dict", "v": items}
        raise UnsupportedValue(f"{path or 'message'}: values of type {type(value).__name__} cannot be carried; use "
                               f"numpy arrays, bool, int, float, str, bytes, None, lists, tuples or mappings")


def _check_kind(kind: str) -> None:
    if not isinstance(kind, str) or not kind:
        raise UnsupportedValue(f"a message kind must be a non-empty string, got {kind!r}")


def _encode(payload: Mapping[str, Any], kind: str) -> tuple[bytes, list[bytes]]:
    """The canonical header (bytes) and the array segments, in order."""
    _check_kind(kind)
    if not isinstance(payload, Mapping):
        raise UnsupportedValue(f"a message is a mapping of names to values, got {type(payload).__name__}")
    enc = _Encoder()
    tree = enc.node(payload, "")
    header = json.dumps({"kind": kind, "tree": tree}, sort_keys=True, separators=(",", ":"),
                        ensure_ascii=True).encode("ascii")
    return header, enc.segments


def _envelope(header: bytes, blob: bytes) -> bytes:
    body = _HEADER_LEN.pack(len(header)) + header + blob
    head = MAGIC + _PREFIX.pack(VERSION, len(body))
    return head + body + hashlib.sha256(head + body).digest()


def to_bytes(payload: Mapping[str, Any], kind: str) -> bytes:
    """The envelope of ``payload`` (see the module docstring); ``kind`` names the message type and is checked by
    :func:`from_bytes`."""
    header, segments = _encode(payload, kind)
    return _envelope(header, b"".join(segments))


# -- decoding -----------------------------------------------------------------------------------------------------

def _open(data: bytes) -> tuple[dict, memoryview]:
    """Check an envelope and return its header and array bytes."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CorruptMessage(f"a privfl message is bytes, got {type(data).__name__}")
    data = bytes(data)
    fixed = len(MAGIC) + _PREFIX.size
    if len(data) < fixed + _HEADER_LEN.size + _DIGEST:
        raise CorruptMessage(f"message of {len(data)} bytes is too short to be a privfl message (truncated?)")
    if data[:len(MAGIC)] != MAGIC:
        raise CorruptMessage("not a privfl message: the magic bytes are wrong")
    version, length = _PREFIX.unpack_from(data, len(MAGIC))
    if version != VERSION:
        raise CorruptMessage(f"privfl message version {version} is not supported (this privfl reads version "
                             f"{VERSION}); run the same privfl version on the server and the clients")
    if len(data) != fixed + length + _DIGEST:
        raise CorruptMessage(f"message length mismatch: the envelope declares a {length}-byte body but "
                             f"{len(data) - fixed - _DIGEST} bytes arrived (truncated or extended in transit)")
    digest = hashlib.sha256(data[:fixed + length]).digest()
    if digest != data[fixed + length:]:
        raise CorruptMessage("message digest mismatch: the message was altered in transit")
    body = memoryview(data)[fixed:fixed + length]
    (header_len,) = _HEADER_LEN.unpack_from(body, 0)
    start = _HEADER_LEN.size
    if header_len > len(body) - start:
        raise CorruptMessage("message header length exceeds the body")
    try:
        header = json.loads(bytes(body[start:start + header_len]).decode("ascii"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptMessage(f"message header is not valid JSON: {exc}") from None
    if not isinstance(header, dict) or set(header) != {"kind", "tree"}:
        raise CorruptMessage("message header must hold exactly a kind and a tree")
    return header, body[start + header_len:]


class _Decoder:
    def __init__(self, blob: memoryview) -> None:
        self.blob = blob
        self.next = 0  # segments must tile the blob in order, with no gap and no overlap

    def _segment(self, node: dict) -> memoryview:
        offset, nbytes = node.get("offset"), node.get("nbytes")
        if not (type(offset) is int and type(nbytes) is int and offset == self.next and nbytes >= 0
                and offset + nbytes <= len(self.blob)):
            raise CorruptMessage("message array segments are inconsistent with the body")
        self.next = offset + nbytes
        return self.blob[offset:offset + nbytes]

    def value(self, node: Any) -> Any:
        if not isinstance(node, dict) or not isinstance(node.get("t"), str):
            raise CorruptMessage("message tree holds a malformed node")
        t = node["t"]
        if t == "array":
            try:
                dtype = np.dtype(node["dtype"])
                shape = tuple(node["shape"])
            except (KeyError, TypeError) as exc:
                raise CorruptMessage(f"message array node is malformed: {exc}") from None
            if dtype.kind not in _KINDS or not all(type(s) is int and s >= 0 for s in shape):
                raise CorruptMessage(f"message array has an unsupported dtype {dtype} or shape {shape}")
            raw = self._segment(node)
            if len(raw) != math.prod(shape) * dtype.itemsize:
                raise CorruptMessage(f"message array of shape {shape} and dtype {dtype} has {len(raw)} bytes")
            return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
        if t == "bytes":
            return bytes(self._segment(node))
        if t == "none":
            return None
        if "v" not in node:
            raise CorruptMessage(f"message node of type {t!r} has no value")
        v = node["v"]
        if t == "bool" and type(v) is bool:
            return v
        if t == "int" and type(v) is int:
            return v
        if t == "float" and isinstance(v, str):
            try:
                return float.fromhex(v)
            except ValueError:
                raise CorruptMessage(f"message float {v!r} is malformed") from None
        if t == "str" and isinstance(v, str):
            return v
        if t in ("list", "tuple") and isinstance(v, list):
            items = [self.value(x) for x in v]
            return items if t == "list" else tuple(items)
        if t == "dict" and isinstance(v, list):
            out = {}
            for item in v:
                if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)) or item[0] in out:
                    raise CorruptMessage("message mapping entries are malformed or repeated")
                out[item[0]] = self.value(item[1])
            return out
        raise CorruptMessage(f"message node of type {t!r} holds {type(v).__name__}")


def from_bytes(data: bytes, kind: str) -> dict[str, Any]:
    """The message in envelope ``data``; :class:`CorruptMessage` if it is not intact or not of ``kind``."""
    _check_kind(kind)
    header, blob = _open(data)
    if header["kind"] != kind:
        raise CorruptMessage(f"expected a {kind!r} message, got a {header['kind']!r} message")
    decoder = _Decoder(blob)
    tree = header["tree"]
    if not isinstance(tree, dict) or tree.get("t") != "dict":
        raise CorruptMessage("a privfl message's top level must be a mapping")
    value = decoder.value(tree)
    if decoder.next != len(blob):
        raise CorruptMessage("message body holds bytes that no value uses")
    return value


__all__ = ["CorruptMessage", "MessageError", "UnsupportedValue", "from_bytes", "to_bytes"]
