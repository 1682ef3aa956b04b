"""The privacy unit, decided in one place.

An algorithm does not branch on the run's privacy unit to build its channels. It declares, for each channel, what its
maths bounds about the value whatever the unit (:func:`channel`):

- ``client``: a bound on the client's whole value: the pipeline's norm clip (:data:`RUN_CLIP`, the run's ``clip``; or a
  :class:`~privfl.core.channels.NormClip` of the algorithm's own bound), a range that holds any value
  (:class:`~privfl.core.channels.RangeBound`), or None when nothing bounds the whole value (a sum over the client's
  records with no public cap);
- ``record``: a bound on one record's term: a sum of per-record terms the algorithm clipped
  (:class:`~privfl.core.channels.PreClipped`), a range (``RangeBound``), post-processing of DP-SGD training
  (:class:`~privfl.core.channels.TrainedPrivately`), or None when the algorithm bounds no record's term on its own.

:func:`channel` then picks, for the run's :class:`~privfl.core.config.PrivacyConfig`:

- without privacy (``epsilon = inf``): the value unclipped (charged a non-private event);
- at client level (``unit="client"``): the whole-value bound, under the run's relation; refused when there is none;
- at record level (``unit="example"``): the record bound when there is one; else the whole-value bound charged as
  **replace-one between the client's two clipped values** (a record changes its client's upload, both ends clipped, so
  a norm clip C bounds it by 2C whatever the record relation), still accounted per client; refused when there is
  neither.

:func:`check_unit` refuses a unit an algorithm does not offer (its class attribute ``units``), the one place where the
units an algorithm supports are checked; :func:`record_level` is the question "does a client's training see its
records only through DP-SGD?", and :func:`at_unit` picks, from what an algorithm declares for each unit, the one
for the run (the form of FOLA's client step).
"""

from __future__ import annotations

import dataclasses

from privfl.core.channels import Channel, NormClip, RangeBound, Unclipped
from privfl.errors import ConfigurationError


class _RunClip:
    """The run's own norm clip (``PrivacyConfig.clip``) on the client's whole value: the default whole-value bound."""

    def __repr__(self) -> str:
        return "RUN_CLIP"


#: the default ``client`` bound of :func:`channel`: the pipeline clips the client's whole value to the run's ``clip``
RUN_CLIP = _RunClip()


def record_level(privacy) -> bool:
    """Whether ``privacy`` is a private run at record level (a client's records are seen only through clipped
    per-record terms or DP-SGD training)."""
    return bool(privacy.private and privacy.unit == "example")


def check_unit(name: str, units, privacy, hint: str = "") -> None:
    """Refuse a private run of algorithm ``name`` at a unit not in ``units`` (its declared units; None: any)."""
    if not privacy.private or not units or privacy.unit in units:
        return
    level = {"client": "client-level", "example": "record-level"}
    offered = " or ".join(level[u] for u in units)
    raise ConfigurationError(f"{name} gives {offered} DP; set unit={units[0]!r}" + (f" ({hint})" if hint else ""))


def _at_unit(clip, unit: str):
    """A range bound carries the unit of the channel that holds it (its sensitivity under add/remove differs)."""
    return dataclasses.replace(clip, unit=unit) if isinstance(clip, RangeBound) else clip


def channel(privacy, name: str, shape, *, client=RUN_CLIP, record=None, adjacency: str | None = None,
            **fields) -> Channel:
    """Channel ``name`` of ``shape`` under ``privacy``'s unit (module docstring). ``adjacency``: the channel's relation
    (default the run's); other keyword arguments are :class:`~privfl.core.channels.Channel` fields (``budget_share``,
    ``value_bound``, ``symmetric``, ``record_sampling_rate``, ``description``)."""
    relation = privacy.adjacency if adjacency is None else adjacency
    if not privacy.private:
        return Channel(name, shape, unit=privacy.unit, clip=Unclipped(), adjacency=relation, **fields)
    whole = NormClip(privacy.clip) if client is RUN_CLIP else client
    if privacy.unit == "client":
        if whole is None:
            raise ConfigurationError(f"channel {name!r} bounds one record's term only, not a client's whole "
                                     "value; run it at record level (unit='example')")
        return Channel(name, shape, unit="client", clip=_at_unit(whole, "client"), adjacency=relation, **fields)
    if record is not None:
        return Channel(name, shape, unit="example", clip=_at_unit(record, "example"), adjacency=relation, **fields)
    if whole is None:
        raise ConfigurationError(f"channel {name!r} declares no bound on a record's term nor on the client's "
                                 "whole value; it cannot be released privately")
    return Channel(name, shape, unit="client", clip=_at_unit(whole, "client"), adjacency="replace_one", **fields)


def at_unit(privacy, *, client, record):
    """What an algorithm declares for each unit, picked for ``privacy``: ``record`` in a private run at record level
    (:func:`record_level`), else ``client`` (client level, and every non-private run). An algorithm whose client
    step differs by unit (FOLA's DP-SGD-trained form beside its paper's online form) declares both forms and this
    picks, as :func:`channel` picks a channel's bound."""
    return record if record_level(privacy) else client


__all__ = ["RUN_CLIP", "at_unit", "channel", "check_unit", "record_level"]
