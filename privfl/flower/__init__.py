"""privfl on Flower (``pip install 'privfl[flower]'``): privfl's messages as Flower records, and a privfl ServerApp
and ClientApp on Flower's Message API for its Deployment Engine (one SuperLink, one SuperNode per organisation).

Importing this package does not import ``flwr``; :mod:`privfl.flower.app` does.
"""

from privfl.flower.records import CorruptMessage, MessageError, UnsupportedValue, from_bytes, from_record, to_bytes, \
    to_record

__all__ = ["CorruptMessage", "MessageError", "UnsupportedValue", "from_bytes", "from_record", "to_bytes",
           "to_record"]
