"""star98, fair, grunfeld, macrodata and randhie (statsmodels) and autompg (mlxtend): real regression sets shipped
inside their packages (no download), federated like diabetes."""

import numpy as np
import pytest

pytest.importorskip("statsmodels")

from privfl.data import DATASETS, make_federated  # noqa: E402
from privfl.data.offline import (FAIR_FEATURES, GRUNFELD_FEATURES, MACRODATA_FEATURES, RANDHIE_FEATURES,  # noqa: E402
                                 RANDHIE_ROWS, STAR98_FEATURES, load_autompg, load_fair, load_grunfeld,
                                 load_macrodata, load_randhie, load_star98)

SETS = {"star98": (load_star98, 303, len(STAR98_FEATURES)), "fair": (load_fair, 6366, len(FAIR_FEATURES)),
        "grunfeld": (load_grunfeld, 220, len(GRUNFELD_FEATURES)),
        "macrodata": (load_macrodata, 203, len(MACRODATA_FEATURES)),
        "randhie": (load_randhie, RANDHIE_ROWS, len(RANDHIE_FEATURES)), "autompg": (load_autompg, 392, 7)}


@pytest.mark.parametrize("name", sorted(SETS))
def test_loads_raw_real_regression_set(name):
    load, rows, features = SETS[name]
    data = load(standardized=False)
    assert data.task == "regression" and data.num_classes == 1 and data.name == name
    assert data.x.shape == (rows, features) and data.y.shape == (rows,)
    assert np.isfinite(data.x).all() and np.isfinite(data.y).all()
    assert data.target_scale == 1.0 and data.y.std() > 0


def test_targets_are_in_their_documented_ranges():
    star = load_star98(standardized=False).y
    assert 0.0 < star.min() and star.max() < 1.0  # a share of students above the national median
    affairs = load_fair(standardized=False).y
    assert affairs.min() == 0.0 and affairs.max() > 50.0
    mpg = load_autompg(standardized=False).y
    assert 9.0 <= mpg.min() and mpg.max() <= 46.6 + 1e-4
    visits = load_randhie(standardized=False).y
    assert visits.min() == 0.0 and np.all(visits == np.round(visits))  # a count
    # the randhie subsample is fixed: the same rows on every call
    np.testing.assert_array_equal(load_randhie(standardized=False).x, load_randhie(standardized=False).x)


@pytest.mark.parametrize("name", sorted(SETS))
def test_make_federated_standardises_on_the_public_split(name):
    _, rows, features = SETS[name]
    assert name in DATASETS
    data = make_federated(name, 10, seed=0, val_fraction=0.1)
    assert len(data.train_parts) == 10 and all(len(p) > 0 for p in data.train_parts)
    assert data.partition == "sorted_chunk" and data.input_shape == (features,)
    assert data.info["standardize"] == "public" and data.info["n_total"] == rows
    counted = sum(len(p) for p in data.train_parts) + len(data.test) + len(data.val) + len(data.public)
    assert counted == rows
    raw = SETS[name][0](standardized=False)
    # the map is fitted on the public split only: its rows are exactly standardised, the clients' are not
    np.testing.assert_allclose(data.public.x.mean(0), 0.0, atol=1e-4)
    assert data.test.target_scale == pytest.approx(data.info["standardizer"].y_std)
    for part in (*data.train_parts, data.test, data.val):
        assert np.isfinite(part.x).all() and np.isfinite(part.y).all()
    # RMSE in original units: the test targets map back onto raw targets
    back = data.test.to_original_units(data.test.y)
    nearest = np.abs(back[:, None] - raw.y[None, :].astype(np.float64)).min(axis=1)
    assert nearest.max() < 1e-4 * max(1.0, float(np.abs(raw.y).max()))


def test_same_seed_same_federation():
    a, b = make_federated("star98", 10, seed=3), make_federated("star98", 10, seed=3)
    for pa, pb in zip(a.train_parts, b.train_parts):
        np.testing.assert_array_equal(pa.x, pb.x)
