"""An algorithm's options as plain values: ``privfl run --option KEY=VALUE`` and ``privfl compare``'s
``[overrides.<algorithm>]`` tables reach ``make_algorithm`` through the same normalisation, so an option means the
same on both front ends (and enters a run's settings, and so its id, the same way).

A value given as text is JSON where it parses as JSON (numbers, ``true``/``false``, ``null``, lists, objects) and a
string otherwise; lists become tuples (a frozen configuration holds no mutable list). Options that are Python objects
(your own model, loss, optimizer, metrics; FedBNR's trained kernel) have no text form: they come through ``--entry``
or the Python API. This module imports nothing heavy (no torch), so parsing stays quick.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from privfl.errors import ConfigurationError

#: constructor options whose values are Python objects, not settings: never given as text
OBJECT_OPTIONS = ("model", "loss", "optimizer", "metrics", "kernel", "kernel_fed")


def option_value(value: Any) -> Any:
    """``value`` as an algorithm receives it: lists (at any depth, inside objects too) as tuples."""
    if isinstance(value, (list, tuple)):
        return tuple(option_value(v) for v in value)
    if isinstance(value, Mapping):
        return {str(k): option_value(v) for k, v in value.items()}
    return value


def parse_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` as ``(key, value)``: VALUE as JSON where it is JSON, else the string itself (so
    ``kernel_aggregation=distillation`` needs no quotes); lists as tuples."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key.isidentifier():
        raise ConfigurationError(f"--option {text!r}: expected KEY=VALUE, e.g. --option meme_lr=0.01 or "
                                 "--option budget_shares=[0.6,0.4]")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key, option_value(value)


def parse_options(texts: Iterable[str] | None) -> dict[str, Any]:
    """Each ``KEY=VALUE`` of ``texts``, as a mapping; a key given twice is refused (which one would count?)."""
    out: dict[str, Any] = {}
    for text in texts or ():
        key, value = parse_option(text)
        if key in out:
            raise ConfigurationError(f"--option {key} is given twice ({out[key]!r} and {value!r}); give it once")
        out[key] = value
    return out


def settable_options(declared: Iterable[str], reserved: Iterable[str] = ()) -> tuple[str, ...]:
    """The options of ``declared`` (``privfl.algorithms.algorithm_options``) that a value given as text can set:
    not a Python object (:data:`OBJECT_OPTIONS`) and not one of ``reserved`` (those a front end sets otherwise)."""
    skip = set(OBJECT_OPTIONS) | set(reserved)
    return tuple(name for name in declared if name not in skip)


__all__ = ["OBJECT_OPTIONS", "option_value", "parse_option", "parse_options", "settable_options"]
