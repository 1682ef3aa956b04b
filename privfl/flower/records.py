"""privfl's messages (:mod:`privfl.core.messages`) as Flower records, exactly and checked.

The **record** form (:func:`to_record`, :func:`from_record`) carries a message in a Flower ``RecordDict``: the bytes
of every array (and ``bytes`` value) as a ``flwr.app.Array`` of uint8 in one ``ArrayRecord``, which Flower transfers
in chunks, and the header (dtypes, shapes, scalars) and the envelope's digest in one ``ConfigRecord``. Decoding
rebuilds the envelope from the record and checks the digest, so both forms have one decoder and one integrity check.

``flwr`` is imported only by the record functions: privfl and the envelope work without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from privfl.errors import CorruptMessage, MessageError, UnsupportedValue
from privfl.core.messages import _DIGEST, VERSION, _encode, _envelope, from_bytes, to_bytes

#: names of the two records in a RecordDict that carries one privfl message
ARRAYS_RECORD = "privfl.arrays"
HEADER_RECORD = "privfl.header"


# -- Flower records -----------------------------------------------------------------------------------------------

def _flwr_app():
    try:
        import flwr.app as flwr_app
    except ImportError:  # pragma: no cover - exercised only where flwr is missing
        raise MessageError("Flower records need flwr: pip install 'privfl[flower]'") from None
    return flwr_app


def to_record(payload: Mapping[str, Any], kind: str):
    """A ``flwr.app.RecordDict`` carrying ``payload``: the bytes of arrays as Flower arrays, the header and the
    envelope's digest in a ConfigRecord (see the module docstring)."""
    fa = _flwr_app()
    header, segments = _encode(payload, kind)
    digest = _envelope(header, b"".join(segments))[-_DIGEST:]
    arrays = fa.ArrayRecord({str(i): fa.Array(np.frombuffer(seg, dtype=np.uint8)) for i, seg in enumerate(segments)})
    meta = fa.ConfigRecord({"version": VERSION, "header": header.decode("ascii"), "digest": digest,
                            "segments": len(segments)})
    return fa.RecordDict({ARRAYS_RECORD: arrays, HEADER_RECORD: meta})


def from_record(record, kind: str) -> dict[str, Any]:
    """The message carried by ``record`` (a ``flwr.app.RecordDict`` made by :func:`to_record`); raises
    :class:`CorruptMessage` if anything in it was altered, dropped or added."""
    fa = _flwr_app()
    if not isinstance(record, fa.RecordDict):
        raise CorruptMessage(f"expected a Flower RecordDict, got {type(record).__name__}")
    if set(record.keys()) != {ARRAYS_RECORD, HEADER_RECORD}:
        raise CorruptMessage(f"a privfl record holds exactly {ARRAYS_RECORD!r} and {HEADER_RECORD!r}; got "
                             f"{sorted(record.keys())}")
    meta, arrays = record[HEADER_RECORD], record[ARRAYS_RECORD]
    if not isinstance(meta, fa.ConfigRecord) or not isinstance(arrays, fa.ArrayRecord):
        raise CorruptMessage("a privfl record's header or arrays have the wrong record type")
    version, header, digest, count = (meta.get(k) for k in ("version", "header", "digest", "segments"))
    if version != VERSION:
        raise CorruptMessage(f"privfl record version {version!r} is not supported (this privfl reads version "
                             f"{VERSION})")
    if not (isinstance(header, str) and isinstance(digest, bytes) and len(digest) == _DIGEST
            and type(count) is int and set(arrays.keys()) == {str(i) for i in range(count)}):
        raise CorruptMessage("a privfl record's header, digest or array list is malformed")
    segments = []
    for i in range(count):
        array = arrays[str(i)]
        if array.dtype != "uint8" or len(array.shape) != 1:
            raise CorruptMessage(f"privfl record segment {i} must be a 1-D uint8 array")
        try:
            segments.append(array.numpy().tobytes())
        except (TypeError, ValueError) as exc:
            raise CorruptMessage(f"privfl record segment {i} cannot be read: {exc}") from None
    try:
        envelope = _envelope(header.encode("ascii"), b"".join(segments))
    except UnicodeEncodeError:
        raise CorruptMessage("a privfl record's header must be ASCII") from None
    return from_bytes(envelope[:-_DIGEST] + digest, kind)


__all__ = ["CorruptMessage", "MessageError", "UnsupportedValue", "from_bytes", "from_record", "to_bytes",
           "to_record"]
