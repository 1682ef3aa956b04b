"""Plain-data encoding of the protocol's frozen dataclasses, for any transport.

``to_plain`` turns a dataclass into a JSON-compatible dict (bytes as base64 text, tuples as lists, nested dataclasses
as dicts, plus a ``"type"`` key); ``from_plain`` validates and rebuilds it using the dataclass's type hints. Only the
types the protocol uses are supported: int, bool, bytes, str, tuples of those, and nested dataclasses. A field with
a default may be absent (it then takes its default).

Every decoding failure raises ``errors.MessageFormatError`` (a ``ValueError``), including input nested too deeply for
the JSON parser (which would otherwise raise ``RecursionError``): a transport can hand any bytes from the network to
``from_json_bytes`` and catch one error.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import typing
from functools import lru_cache

from .errors import MessageFormatError

__all__ = ["to_plain", "from_plain", "to_json_bytes", "from_json_bytes"]


@lru_cache(maxsize=None)
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _encode(value, hint):
    origin = typing.get_origin(hint)
    if origin is tuple:
        item_hint = typing.get_args(hint)[0]
        return [_encode(v, item_hint) for v in value]
    if hint is bytes:
        return base64.b64encode(value).decode("ascii")
    if dataclasses.is_dataclass(hint):
        return to_plain(value, with_type=False)
    return value


def _decode(value, hint, where: str):
    origin = typing.get_origin(hint)
    if origin is tuple:
        if not isinstance(value, list):
            raise MessageFormatError(f"{where}: expected a list")
        item_hint = typing.get_args(hint)[0]
        return tuple(_decode(v, item_hint, f"{where}[{i}]") for i, v in enumerate(value))
    if hint is bytes:
        if not isinstance(value, str):
            raise MessageFormatError(f"{where}: expected base64 text")
        try:
            return base64.b64decode(value.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError) as exc:
            raise MessageFormatError(f"{where}: invalid base64") from exc
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise MessageFormatError(f"{where}: expected an object")
        return _build(hint, value, where)
    if hint is bool:
        if not isinstance(value, bool):
            raise MessageFormatError(f"{where}: expected true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise MessageFormatError(f"{where}: expected an integer")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise MessageFormatError(f"{where}: expected a string")
        return value
    raise TypeError(f"{where}: unsupported field type {hint!r}")


def _build(cls, data: dict, where: str):
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = {f.name for f in fields}
    extra = set(data) - names - {"type"}
    if extra:
        raise MessageFormatError(f"{where}: unexpected field(s) {sorted(extra)}")
    hints = _hints(cls)
    kwargs = {}
    for f in fields:
        if f.name not in data:
            if f.default is not dataclasses.MISSING:  # optional field (e.g. a signature of the malicious variant)
                continue
            raise MessageFormatError(f"{where}: missing field {f.name!r}")
        kwargs[f.name] = _decode(data[f.name], hints[f.name], f"{where}.{f.name}")
    return cls(**kwargs)


def to_plain(obj, *, with_type: bool = True) -> dict:
    hints = _hints(type(obj))
    out = {"type": type(obj).__name__} if with_type else {}
    for f in dataclasses.fields(obj):
        if f.init:
            out[f.name] = _encode(getattr(obj, f.name), hints[f.name])
    return out


def from_plain(cls, data: dict):
    if not isinstance(data, dict):
        raise MessageFormatError(f"{cls.__name__}: expected a dict")
    if "type" in data and data["type"] != cls.__name__:
        raise MessageFormatError(f"expected a {cls.__name__}, got a {data['type']!r}")
    try:
        return _build(cls, data, cls.__name__)
    except MessageFormatError:
        raise
    except ValueError as exc:  # a field's own check (e.g. a 32-byte key of the wrong length)
        raise MessageFormatError(f"{cls.__name__}: {exc}") from exc
    except RecursionError:
        raise MessageFormatError(f"{cls.__name__}: nested too deeply") from None


def to_json_bytes(obj) -> bytes:
    return json.dumps(to_plain(obj), separators=(",", ":")).encode("utf-8")


def from_json_bytes(cls, raw: bytes):
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise MessageFormatError(f"{cls.__name__}: expected bytes")
    try:
        data = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MessageFormatError(f"{cls.__name__}: not valid JSON") from exc
    except RecursionError:
        raise MessageFormatError(f"{cls.__name__}: JSON nested too deeply") from None
    return from_plain(cls, data)
