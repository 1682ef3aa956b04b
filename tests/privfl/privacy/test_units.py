"""The privacy unit is decided in one place (privfl/privacy/units.py), never in an algorithm."""

import ast
import math
from pathlib import Path

import pytest

from privfl.core.channels import NormClip, PreClipped, RangeBound, TrainedPrivately, Unclipped
from privfl.core.config import PrivacyConfig
from privfl.errors import ConfigurationError
from privfl.privacy.units import RUN_CLIP, channel, check_unit, record_level

ROOT = Path(__file__).resolve().parents[3]

CLIENT = PrivacyConfig(epsilon=3.0, unit="client", clip=0.5)
EXAMPLE = PrivacyConfig(epsilon=3.0, unit="example", clip=0.5, accountant="pld")
OFF = PrivacyConfig(epsilon=math.inf)


def test_without_privacy_a_channel_is_unclipped_at_the_runs_unit():
    c = channel(OFF, "update", (4,), client=None, record=TrainedPrivately())
    assert isinstance(c.clip, Unclipped) and c.unit == OFF.unit and not c.private


def test_at_client_level_the_whole_value_bound_applies_the_run_clip_by_default():
    c = channel(CLIENT, "update", (4,), record=TrainedPrivately())
    assert c.unit == "client" and c.clip == NormClip(0.5) and c.adjacency == CLIENT.adjacency
    own = channel(CLIENT, "scatter", (2, 2), client=NormClip(7.0), record=PreClipped(1.0, "squared_sum"))
    assert own.clip == NormClip(7.0)


def test_at_client_level_a_channel_bounding_records_only_is_refused_naming_the_fix():
    with pytest.raises(ConfigurationError, match="unit='example'"):
        channel(CLIENT, "gradient_sum", (4,), client=None, record=PreClipped(1.0, "sum"))


def test_at_record_level_the_record_bound_applies_under_the_runs_relation():
    c = channel(EXAMPLE, "fisher", (4,), client=None, record=PreClipped(0.5, "squared_sum"))
    assert c.unit == "example" and c.clip == PreClipped(0.5, "squared_sum") and c.adjacency == EXAMPLE.adjacency


def test_at_record_level_a_whole_value_clip_alone_is_charged_replace_one_between_two_clipped_uploads():
    c = channel(EXAMPLE, "update", (4,), client=NormClip(2.0))
    assert c.unit == "client" and c.adjacency == "replace_one"
    assert c.sensitivity == pytest.approx(4.0)  # a record moves its client's clipped upload by up to 2C
    with pytest.raises(ConfigurationError, match="cannot be released privately"):
        channel(EXAMPLE, "update", (4,), client=None)


@pytest.mark.parametrize("privacy, unit", [(CLIENT, "client"), (EXAMPLE, "example")])
def test_a_range_bound_takes_the_unit_of_the_channel_that_holds_it(privacy, unit):
    rows = RangeBound(math.sqrt(2), 5)
    c = channel(privacy, "probs", (5, 3), client=rows, record=rows)
    assert c.unit == unit and c.clip.unit == unit


def test_check_unit_refuses_an_undeclared_unit_with_the_hint():
    check_unit("a", None, CLIENT)
    check_unit("a", ("client",), PrivacyConfig(epsilon=math.inf, unit="example"))  # no privacy: no unit to honour
    with pytest.raises(ConfigurationError, match=r"gives client-level DP; set unit='client' \(use b\)"):
        check_unit("a", ("client",), EXAMPLE, "use b")
    assert record_level(EXAMPLE) and not record_level(CLIENT) and not record_level(OFF)
    assert repr(RUN_CLIP) == "RUN_CLIP"


#: the algorithms that read the run's unit themselves: none (every decision by unit is privfl.privacy.units')
UNIT_READERS: dict = {}
#: the algorithms whose client step differs by unit declare one form per unit and privacy.units.at_unit picks: FOLA
#: releases natural-parameter changes at client level and DP-SGD's mean with Fisher sums at record level; HBFL's meme
#: trains on shuffled mini-batches, or on DP-SGD's lots with privatised gradients at record level
FORM_DECLARERS = {"fola.py": 1, "hbfl.py": 1}


def _unit_reads(path: Path, names=("record_level", "client_level")) -> int:
    """Lines of ``path`` that read a privacy unit: ``<x>.unit`` attributes, or calls of units.record_level/client_level."""
    lines = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "unit" and "at_unit" not in names:
            lines.add(node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names:
            lines.add(node.lineno)
    return len(lines)


def test_no_algorithm_decides_its_privacy_unit():
    paths = sorted((ROOT / "privfl" / "algorithms").glob("*.py"))
    found = {p.name: _unit_reads(p) for p in paths}
    assert {name: n for name, n in found.items() if n} == UNIT_READERS
    declared = {p.name: _unit_reads(p, ("at_unit",)) for p in paths}
    assert {name: n for name, n in declared.items() if n} == FORM_DECLARERS
