"""The five UCI regression sets of FedBNR (Yu et al., Table 1), downloaded once and cached, parsed with the standard
library and numpy only.

- ``ccpp``: ``Folds5x2_pp.xlsx`` (first sheet), 9,568 rows; target PE; features AT, V, AP, RH.
- ``bike``: ``SeoulBikeData.csv`` (Latin-1), 8,760 rows; target Rented Bike Count; features Hour and the 8 weather
  columns, Seasons one-hot (4), Holiday, Functioning Day (15); Date dropped.
- ``parkinsons``: ``parkinsons_updrs.data``, 5,875 rows; target total_UPDRS (or ``target="motor_UPDRS"``);
  features age, sex, test_time and the 16 voice measures (19); subject# dropped.
- ``sml2010``: ``NEW-DATA-1.T15.txt`` + ``NEW-DATA-2.T15.txt``, 4,137 rows; target the dining-room temperature
  (column 3); features columns 5-24 (20); date, time and both indoor temperatures dropped.
- ``skillcraft``: ``SkillCraft1_Dataset.csv``, 3,338 of 3,395 rows (rows with '?' dropped); target LeagueIndex;
  the 18 other columns; GameID dropped.

"Bike" is Seoul bike sharing demand, the set FedBNR cites ([48]; its 7,008 + 876 train/test rows are 80% + 10% of
8,760). Files go to ``ROOT/uci/<name>/``: either the official zip as downloaded, or its members extracted there.
"""

from __future__ import annotations

import csv
import io
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from privfl.data.cache import download_url, resolve_root
from privfl.data.dataset import ArrayDataset
from privfl.data.errors import DatasetError, DatasetNotFoundError
from privfl.data.split import standardize
from privfl.data.xlsx import read_xlsx


@dataclass(frozen=True)
class UciSpec:
    """Where one UCI set comes from and how it is read."""

    name: str
    url: str
    archive: str
    members: tuple[str, ...]
    rows: int
    parse: Callable[[dict[str, bytes], str | None], tuple[np.ndarray, np.ndarray, tuple[str, ...]]]
    description: str


def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def _csv_rows(raw: bytes) -> list[list[str]]:
    return [row for row in csv.reader(io.StringIO(_decode(raw))) if row and any(cell.strip() for cell in row)]


def _column(header: list[str], name: str, source: str) -> int:
    stripped = [h.strip() for h in header]
    if name not in stripped:
        raise DatasetError(f"{source}: column {name!r} not found; header is {stripped}")
    return stripped.index(name)


def _to_float(value: str, where: str) -> float:
    try:
        return float(value)
    except ValueError as err:
        raise DatasetError(f"{where}: cannot read {value!r} as a number") from err


def _parse_ccpp(files: dict[str, bytes], target: str | None):
    rows = read_xlsx(files["Folds5x2_pp.xlsx"], sheet=0)
    if not rows:
        raise DatasetError("Folds5x2_pp.xlsx: first sheet is empty")
    header = [str(h).strip() if h is not None else "" for h in rows[0]]
    names = ("AT", "V", "AP", "RH")
    cols = [_column(header, n, "Folds5x2_pp.xlsx") for n in names]
    t = _column(header, target or "PE", "Folds5x2_pp.xlsx")
    body = [r for r in rows[1:] if any(v is not None for v in r)]
    try:
        x = np.array([[float(r[c]) for c in cols] for r in body])
        y = np.array([float(r[t]) for r in body])
    except (TypeError, ValueError) as err:
        raise DatasetError("Folds5x2_pp.xlsx: a data cell is empty or not a number") from err
    return x, y, names


_SEASONS = ("Spring", "Summer", "Autumn", "Winter")
_BIKE_NUMERIC = ("Hour", "Temperature", "Humidity", "Wind speed", "Visibility", "Dew point temperature",
                 "Solar Radiation", "Rainfall", "Snowfall")


def _parse_bike(files: dict[str, bytes], target: str | None):
    if target not in (None, "Rented Bike Count"):
        raise DatasetError("bike has one target, 'Rented Bike Count'")
    rows = _csv_rows(files["SeoulBikeData.csv"])
    header, body = rows[0], rows[1:]
    if len(header) != 14 or header[0].strip() != "Date":
        raise DatasetError(f"SeoulBikeData.csv: expected 14 columns starting with 'Date', got {header}")
    x, y = [], []
    for i, r in enumerate(body, start=2):
        where = f"SeoulBikeData.csv line {i}"
        if len(r) != 14:
            raise DatasetError(f"{where}: expected 14 fields, got {len(r)}")
        season = r[11].strip()
        if season not in _SEASONS:
            raise DatasetError(f"{where}: unknown season {season!r}")
        numeric = [_to_float(v, where) for v in r[2:11]]
        onehot = [1.0 if season == s else 0.0 for s in _SEASONS]
        holiday = 1.0 if r[12].strip() == "Holiday" else 0.0
        functioning = 1.0 if r[13].strip() == "Yes" else 0.0
        x.append(numeric + onehot + [holiday, functioning])
        y.append(_to_float(r[1], where))
    names = _BIKE_NUMERIC + tuple(f"Season={s}" for s in _SEASONS) + ("Holiday", "Functioning Day")
    return np.array(x), np.array(y), names


def _parse_parkinsons(files: dict[str, bytes], target: str | None):
    target = target or "total_UPDRS"
    if target not in ("total_UPDRS", "motor_UPDRS"):
        raise DatasetError(f"parkinsons target must be 'total_UPDRS' or 'motor_UPDRS', got {target!r}")
    rows = _csv_rows(files["parkinsons_updrs.data"])
    header = [h.strip() for h in rows[0]]
    dropped = {"subject#", "motor_UPDRS", "total_UPDRS"}
    for name in dropped:
        _column(header, name, "parkinsons_updrs.data")
    keep = [i for i, h in enumerate(header) if h not in dropped]
    t = header.index(target)
    data = np.array([[_to_float(v, f"parkinsons_updrs.data line {i}") for v in r]
                     for i, r in enumerate(rows[1:], start=2)])
    if data.shape[1] != len(header):
        raise DatasetError("parkinsons_updrs.data: rows and header have different widths")
    return data[:, keep], data[:, t], tuple(header[i] for i in keep)


_SML_COLUMNS = ("Date", "Time", "Temperature_Comedor_Sensor", "Temperature_Habitacion_Sensor",
                "Weather_Temperature", "CO2_Comedor_Sensor", "CO2_Habitacion_Sensor", "Humedad_Comedor_Sensor",
                "Humedad_Habitacion_Sensor", "Lighting_Comedor_Sensor", "Lighting_Habitacion_Sensor",
                "Precipitacion", "Meteo_Exterior_Crepusculo", "Meteo_Exterior_Viento", "Meteo_Exterior_Sol_Oest",
                "Meteo_Exterior_Sol_Est", "Meteo_Exterior_Sol_Sud", "Meteo_Exterior_Piranometro",
                "Exterior_Entalpic_1", "Exterior_Entalpic_2", "Exterior_Entalpic_turbo",
                "Temperature_Exterior_Sensor", "Humedad_Exterior_Sensor", "Day_Of_Week")
_DATE = re.compile(r"^\d{1,2}/\d{1,2}/\d{4}$")


def _parse_sml(files: dict[str, bytes], target: str | None):
    target = target or "Temperature_Comedor_Sensor"
    if target not in ("Temperature_Comedor_Sensor", "Temperature_Habitacion_Sensor"):
        raise DatasetError("sml2010 target must be 'Temperature_Comedor_Sensor' or 'Temperature_Habitacion_Sensor'")
    t = _SML_COLUMNS.index(target)
    feats = list(range(4, 24))
    x, y = [], []
    for member in ("NEW-DATA-1.T15.txt", "NEW-DATA-2.T15.txt"):
        for i, line in enumerate(_decode(files[member]).splitlines(), start=1):
            tokens = line.split()
            if not tokens or line.lstrip().startswith("#") or not _DATE.match(tokens[0]):
                continue  # header ("1:Date 2:Time ...", possibly behind '#') and blank lines
            if len(tokens) < 24:
                raise DatasetError(f"{member} line {i}: expected 24 fields, got {len(tokens)}")
            values = [_to_float(v, f"{member} line {i}") for v in tokens[2:24]]
            row = [np.nan, np.nan] + values
            x.append([row[j] for j in feats])
            y.append(row[t])
    if not y:
        raise DatasetError("sml2010: no data rows found in NEW-DATA-1.T15.txt / NEW-DATA-2.T15.txt")
    return np.array(x), np.array(y), tuple(_SML_COLUMNS[j] for j in feats)


def _parse_skillcraft(files: dict[str, bytes], target: str | None):
    target = target or "LeagueIndex"
    rows = _csv_rows(files["SkillCraft1_Dataset.csv"])
    header = [h.strip() for h in rows[0]]
    _column(header, "GameID", "SkillCraft1_Dataset.csv")
    t = _column(header, target, "SkillCraft1_Dataset.csv")
    keep = [i for i, h in enumerate(header) if h not in ("GameID", target)]
    x, y = [], []
    for i, r in enumerate(rows[1:], start=2):
        if len(r) != len(header):
            raise DatasetError(f"SkillCraft1_Dataset.csv line {i}: expected {len(header)} fields, got {len(r)}")
        if any(v.strip() == "?" for v in r):
            continue  # missing Age/HoursPerWeek/TotalHours (the professional league)
        vals = [_to_float(v, f"SkillCraft1_Dataset.csv line {i}") for v in r]
        x.append([vals[j] for j in keep])
        y.append(vals[t])
    return np.array(x), np.array(y), tuple(header[j] for j in keep)


UCI_DATASETS: dict[str, UciSpec] = {
    "ccpp": UciSpec("ccpp", "https://archive.ics.uci.edu/static/public/294/combined+cycle+power+plant.zip",
                    "combined+cycle+power+plant.zip", ("Folds5x2_pp.xlsx",), 9568, _parse_ccpp,
                    "Combined Cycle Power Plant (Tufekci 2014): net hourly electrical output PE (MW)"),
    "bike": UciSpec("bike", "https://archive.ics.uci.edu/static/public/560/seoul+bike+sharing+demand.zip",
                    "seoul+bike+sharing+demand.zip", ("SeoulBikeData.csv",), 8760, _parse_bike,
                    "Seoul bike sharing demand (Sathishkumar & Cho 2020): bikes rented per hour"),
    "parkinsons": UciSpec("parkinsons",
                          "https://archive.ics.uci.edu/static/public/189/parkinsons+telemonitoring.zip",
                          "parkinsons+telemonitoring.zip", ("parkinsons_updrs.data",), 5875, _parse_parkinsons,
                          "Parkinsons telemonitoring (Tsanas et al. 2010): total UPDRS score"),
    "sml2010": UciSpec("sml2010", "https://archive.ics.uci.edu/static/public/274/sml2010.zip", "sml2010.zip",
                       ("NEW-DATA-1.T15.txt", "NEW-DATA-2.T15.txt"), 4137, _parse_sml,
                       "SML2010 (Zamora-Martinez et al. 2014): indoor dining-room temperature (C)"),
    "skillcraft": UciSpec("skillcraft",
                          "https://archive.ics.uci.edu/static/public/272/skillcraft1+master+table+dataset.zip",
                          "skillcraft1+master+table+dataset.zip", ("SkillCraft1_Dataset.csv",), 3338,
                          _parse_skillcraft, "SkillCraft1 (Thompson et al. 2013): StarCraft II league index 1-8"),
}


def uci_folder(name: str, root: str | os.PathLike | None = None) -> Path:
    """``ROOT/uci/<name>``, where ``load_uci`` looks for and caches the files of ``name``."""
    return resolve_root(root) / "uci" / name


def _basename(name: str) -> str:
    return name.replace("\\", "/").rsplit("/", 1)[-1]


def _find_in_zip(zf: zipfile.ZipFile, member: str, depth: int = 0) -> bytes | None:
    """A member found by file name anywhere in the archive, or inside a zip inside it (one level)."""
    for info in zf.infolist():
        if not info.is_dir() and _basename(info.filename).lower() == member.lower():
            return zf.read(info)
    if depth == 0:
        for info in zf.infolist():
            if info.filename.lower().endswith(".zip"):
                with zipfile.ZipFile(io.BytesIO(zf.read(info))) as inner:
                    found = _find_in_zip(inner, member, depth + 1)
                    if found is not None:
                        return found
    return None


def _read_members(spec: UciSpec, folder: Path) -> dict[str, bytes] | None:
    loose = {m: folder / m for m in spec.members}
    if all(p.is_file() for p in loose.values()):
        return {m: p.read_bytes() for m, p in loose.items()}
    archive = folder / spec.archive
    if not archive.is_file():
        return None
    try:
        with zipfile.ZipFile(archive) as zf:
            found = {m: _find_in_zip(zf, m) for m in spec.members}
    except zipfile.BadZipFile as err:
        raise DatasetError(f"{archive} is not a valid zip archive; delete it and pass download=True") from err
    missing = [m for m, data in found.items() if data is None]
    if missing:
        raise DatasetError(f"{archive} does not contain {', '.join(missing)}; delete it and pass download=True")
    return found  # type: ignore[return-value]


def load_uci(name: str, root: str | os.PathLike | None = None, download: bool = True, *,
             target: str | None = None, standardized: bool = True) -> ArrayDataset:
    """One of FedBNR's UCI regression sets: ``"ccpp"``, ``"bike"``, ``"parkinsons"``, ``"sml2010"``,
    ``"skillcraft"`` (see the module docstring for columns and targets).

    Files are looked up in ``ROOT/uci/<name>/`` (``ROOT`` defaults to ``$PRIVFL_DATA`` or ``~/.cache/privfl``) and,
    with ``download=True``, the official zip is fetched there once. With ``standardized`` features and target are
    standardised over all rows (``target_scale`` keeps the target's std for reporting RMSE in original units), for
    centralised analysis; ``make_federated`` loads the raw rows and fits the standardisation on its public reference
    split, which no client holds.
    """
    key = str(name).lower()
    if key not in UCI_DATASETS:
        raise DatasetError(f"unknown UCI data set {name!r}; choose one of {sorted(UCI_DATASETS)}")
    spec = UCI_DATASETS[key]
    folder = uci_folder(key, root)
    files = _read_members(spec, folder)
    if files is None:
        if not download:
            raise DatasetNotFoundError(
                f"{key} is not in {folder}: put {spec.archive} (from {spec.url}) or its extracted "
                f"{', '.join(spec.members)} there, or pass download=True")
        download_url(spec.url, folder / spec.archive)
        files = _read_members(spec, folder)
        if files is None:  # pragma: no cover - download_url either writes the file or raises
            raise DatasetError(f"download of {spec.url} left no archive in {folder}")
    x, y, _ = spec.parse(files, target)
    if len(y) == 0:
        raise DatasetError(f"{key}: no data rows parsed from {folder}")
    data = ArrayDataset(x.astype(np.float32), y.astype(np.float32), "regression", 1, key)
    return standardize(data) if standardized else data


def uci_feature_names(name: str, root: str | os.PathLike | None = None, *, target: str | None = None,
                      ) -> tuple[str, ...]:
    """The feature names of a cached UCI set, in column order (reads the files; never downloads)."""
    spec = UCI_DATASETS[str(name).lower()]
    files = _read_members(spec, uci_folder(spec.name, root))
    if files is None:
        raise DatasetNotFoundError(f"{name} is not cached in {uci_folder(spec.name, root)}")
    return spec.parse(files, target)[2]


__all__ = ["UCI_DATASETS", "UciSpec", "load_uci", "uci_feature_names", "uci_folder"]
