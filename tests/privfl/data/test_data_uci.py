"""UCI regression loaders, run offline on archives written here in each data set's published format, plus the
standard-library xlsx reader and the download-and-cache path (with the network call replaced by local bytes)."""

from __future__ import annotations

import csv
import io
import urllib.request
import zipfile
from xml.sax.saxutils import escape

import numpy as np
import pytest

from privfl.data import (DatasetError, DatasetNotFoundError, Standardizer, federated_from_arrays, load_diabetes,
                         load_uci, make_federated)
from privfl.data.uci import UCI_DATASETS, uci_feature_names, uci_folder
from privfl.data.xlsx import read_xlsx

RAW = load_diabetes(standardized=False)  # real numbers to fill the files with


def _col(i: int) -> str:
    s = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        s = chr(65 + r) + s
    return s


def make_xlsx(sheets: dict[str, list[list]]) -> bytes:
    """A minimal SpreadsheetML package as Excel writes it: header strings in the shared-string table, numbers as
    plain ``<v>`` cells; one inline string and one rich-text shared string to exercise the reader."""
    shared: list[str] = []
    sheet_xml = []
    for rows in sheets.values():
        out = []
        for r, row in enumerate(rows, start=1):
            cells = []
            for c, value in enumerate(row):
                ref = f"{_col(c)}{r}"
                if value is None:
                    continue
                if isinstance(value, str) and value.startswith("inline:"):
                    cells.append(f'<c r="{ref}" t="inlineStr"><is><t>{escape(value[7:])}</t></is></c>')
                elif isinstance(value, str):
                    if value not in shared:
                        shared.append(value)
                    cells.append(f'<c r="{ref}" t="s"><v>{shared.index(value)}</v></c>')
                else:
                    cells.append(f'<c r="{ref}" s="1"><v>{value!r}</v></c>')
            out.append(f'<row r="{r}">{"".join(cells)}</row>')
        sheet_xml.append(
            '<?xml version="1.0" encoding="UTF-8" standalone="yes"?>\n'
            '<worksheet xmlns="http://schemas.openxmlformats.org/spreadsheetml/2006/main" '
            'xmlns:r="http://schemas.openxmlformats.org/officeDocument/2006/relationships">'
            f'<sheetData>{"".join(out)}</sheetData></worksheet>')
    sis = []
    for s in shared:
        if len(s) > 1:  # rich text: split into two runs
            sis.append(f"<si><r><t>{escape(s[0])}</t></r><r><rPr><b/></rPr><t>{escape(s[1:])}</t></r></si>")
        else:
            sis.append(f"<si><t>{escape(s)}</t></si>")
    names = list(sheets)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("[Content_Types].xml",
                   '<?xml version="1.0" encoding="UTF-8"?><Types '
                   'xmlns="http://schemas.openxmlformats.org/package/2006/content-types"/>')
        z.writestr("_rels/.rels", '<?xml version="1.0"?><Relationships '
                   'xmlns="http://schemas.openxmlformats.org/package/2006/relationships"/>')
        z.writestr("xl/workbook.xml",
                   '<?xml version="1.0" encoding="UTF-8"?>'
                   '<workbook xmlns="http://schemas.openxmlformats.org/spreadsheetml/2006/main" '
                   'xmlns:r="http://schemas.openxmlformats.org/officeDocument/2006/relationships"><sheets>'
                   + "".join(f'<sheet name="{n}" sheetId="{i + 1}" r:id="rId{i + 1}"/>' for i, n in enumerate(names))
                   + "</sheets></workbook>")
        z.writestr("xl/_rels/workbook.xml.rels",
                   '<?xml version="1.0" encoding="UTF-8"?>'
                   '<Relationships xmlns="http://schemas.openxmlformats.org/package/2006/relationships">'
                   + "".join(f'<Relationship Id="rId{i + 1}" Type="http://schemas.openxmlformats.org/'
                             f'officeDocument/2006/relationships/worksheet" Target="worksheets/sheet{i + 1}.xml"/>'
                             for i in range(len(names)))
                   + f'<Relationship Id="rId{len(names) + 1}" Type="http://schemas.openxmlformats.org/'
                   'officeDocument/2006/relationships/sharedStrings" Target="sharedStrings.xml"/></Relationships>')
        for i, xml in enumerate(sheet_xml):
            z.writestr(f"xl/worksheets/sheet{i + 1}.xml", xml)
        z.writestr("xl/sharedStrings.xml",
                   '<?xml version="1.0" encoding="UTF-8"?><sst '
                   f'xmlns="http://schemas.openxmlformats.org/spreadsheetml/2006/main">{"".join(sis)}</sst>')
    return buf.getvalue()


def _zip(path, members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    data = buf.getvalue()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return data


def _archive_path(root, name):
    return uci_folder(name, root) / UCI_DATASETS[name].archive


# --- the published formats --------------------------------------------------------------------------------------

def ccpp_archive(root, n=60):
    x, y = RAW.x[:n, :4].astype(np.float64), RAW.y[:n].astype(np.float64)
    rows = [["AT", "V", "AP", "RH", "PE"]] + [[*map(float, x[i]), float(y[i])] for i in range(n)]
    shuffled = [rows[0]] + rows[1:][::-1]  # the real workbook's later sheets are reshuffles of the first
    book = make_xlsx({"Sheet1": rows, "Sheet2": shuffled})
    data = _zip(_archive_path(root, "ccpp"), {"CCPP/Folds5x2_pp.xlsx": book, "CCPP/Folds5x2_pp.ods": b"PK-ods",
                                              "CCPP/Readme.txt": b"Combined Cycle Power Plant"})
    return data, x, y


BIKE_HEADER = ["Date", "Rented Bike Count", "Hour", "Temperature(\u00b0C)", "Humidity(%)", "Wind speed (m/s)",
               "Visibility (10m)", "Dew point temperature(\u00b0C)", "Solar Radiation (MJ/m2)", "Rainfall(mm)",
               "Snowfall (cm)", "Seasons", "Holiday", "Functioning Day"]


def bike_archive(root, n=48):
    seasons = ["Winter", "Spring", "Summer", "Autumn"]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\r\n")
    w.writerow(BIKE_HEADER)
    expect_x, expect_y = [], []
    for i in range(n):
        numeric = [i % 24] + [round(float(v), 2) for v in RAW.x[i, :8]]
        season = seasons[i % 4]
        holiday = "Holiday" if i % 5 == 0 else "No Holiday"
        func = "No" if i % 7 == 0 else "Yes"
        count = int(RAW.y[i])
        w.writerow([f"{1 + i // 24:02d}/12/2017", count, *numeric, season, holiday, func])
        onehot = [1.0 if season == s else 0.0 for s in ("Spring", "Summer", "Autumn", "Winter")]
        expect_x.append(numeric + onehot + [float(holiday == "Holiday"), float(func == "Yes")])
        expect_y.append(count)
    raw = buf.getvalue().encode("latin-1")  # the published file is Latin-1 ("Temperature(\xb0C)")
    return _zip(_archive_path(root, "bike"), {"SeoulBikeData.csv": raw}), np.array(expect_x), np.array(expect_y)


PARK_HEADER = ["subject#", "age", "sex", "test_time", "motor_UPDRS", "total_UPDRS", "Jitter(%)", "Jitter(Abs)",
               "Jitter:RAP", "Jitter:PPQ5", "Jitter:DDP", "Shimmer", "Shimmer(dB)", "Shimmer:APQ3", "Shimmer:APQ5",
               "Shimmer:APQ11", "Shimmer:DDA", "NHR", "HNR", "RPDE", "DFA", "PPE"]


def parkinsons_file(n=40):
    rng = np.random.default_rng(0)
    table = np.round(rng.uniform(0, 50, size=(n, 22)), 4)
    table[:, 0] = 1 + np.arange(n) // 10  # subject#
    lines = [",".join(PARK_HEADER)] + [",".join(repr(float(v)) if j else str(int(v)) for j, v in enumerate(row))
                                       for row in table]
    return ("\r\n".join(lines) + "\r\n").encode(), table


SML_NAMES = ["Date", "Time", "Temperature_Comedor_Sensor", "Temperature_Habitacion_Sensor", "Weather_Temperature",
             "CO2_Comedor_Sensor", "CO2_Habitacion_Sensor", "Humedad_Comedor_Sensor", "Humedad_Habitacion_Sensor",
             "Lighting_Comedor_Sensor", "Lighting_Habitacion_Sensor", "Precipitacion", "Meteo_Exterior_Crepusculo",
             "Meteo_Exterior_Viento", "Meteo_Exterior_Sol_Oest", "Meteo_Exterior_Sol_Est", "Meteo_Exterior_Sol_Sud",
             "Meteo_Exterior_Piranometro", "Exterior_Entalpic_1", "Exterior_Entalpic_2", "Exterior_Entalpic_turbo",
             "Temperature_Exterior_Sensor", "Humedad_Exterior_Sensor", "Day_Of_Week"]


def sml_archive(root, n1=30, n2=12):
    rng = np.random.default_rng(1)
    values = np.round(rng.uniform(0, 40, size=(n1 + n2, 22)), 4)
    values[:, 16:19] = 0.0  # the enthalpic columns are all zero in the real files
    header = " ".join(f"{i + 1}:{name}" for i, name in enumerate(SML_NAMES))

    def body(rows, start):
        return "".join(f"{13 + (start + k) // 96:02d}/03/2012 {(start + k) % 24:02d}:{15 * (k % 4):02d} "
                       + " ".join(repr(float(v)) for v in row) + " \n" for k, row in enumerate(rows))
    f1 = ("#" + header + "\n" + body(values[:n1], 0)).encode()
    f2 = (header + "\n" + body(values[n1:], n1)).encode()  # header without '#', as some copies have it
    data = _zip(_archive_path(root, "sml2010"), {"NEW-DATA-1.T15.txt": f1, "NEW-DATA-2.T15.txt": f2})
    return data, values


SC_HEADER = ["GameID", "LeagueIndex", "Age", "HoursPerWeek", "TotalHours", "APM", "SelectByHotkeys",
             "AssignToHotkeys", "UniqueHotkeys", "MinimapAttacks", "MinimapRightClicks", "NumberOfPACs",
             "GapBetweenPACs", "ActionLatency", "ActionsInPAC", "TotalMapExplored", "WorkersMade",
             "UniqueUnitsMade", "ComplexUnitsMade", "ComplexAbilitiesUsed"]


def skillcraft_archive(root, n=30, *, write=True):
    rng = np.random.default_rng(2)
    table = np.round(rng.uniform(0, 100, size=(n, 20)), 6)
    table[:, 0] = 52 + np.arange(n)
    table[:, 1] = 1 + np.arange(n) % 8
    missing = {3, 17}
    buf = io.StringIO()
    w = csv.writer(buf, quoting=csv.QUOTE_NONNUMERIC, lineterminator="\n")
    w.writerow(SC_HEADER)
    for i, row in enumerate(table):
        cells = [int(row[0]), int(row[1]), *map(float, row[2:])]
        if i in missing:  # professional players: Age, HoursPerWeek, TotalHours unknown
            cells[2:5] = ["?", "?", "?"]
        w.writerow(cells)
    data = _zip(_archive_path(root, "skillcraft") if write else None,
                {"SkillCraft1_Dataset.csv": buf.getvalue().encode()})
    keep = np.array([i for i in range(n) if i not in missing])
    return data, table[keep]


# --- tests -------------------------------------------------------------------------------------------------------

def test_xlsx_reader_reads_values_and_picks_sheets():
    rows = [["a", "inline:b", None, "cd"], [1.5, -2.0, 3e-5, 7.0], [None, None, None, None], [4.0]]
    book = make_xlsx({"First": rows, "Second": [["z"], [9.0]]})
    got = read_xlsx(book)
    assert got[0] == ["a", "b", None, "cd"]
    assert got[1] == [1.5, -2.0, 3e-5, 7.0] and got[3] == [4.0, None, None, None]
    assert read_xlsx(book, sheet="Second") == [["z"], [9.0]]
    with pytest.raises(DatasetError):
        read_xlsx(book, sheet=5)
    with pytest.raises(DatasetError, match="zip"):
        read_xlsx(b"not a workbook")


def test_ccpp_from_zipped_xlsx(tmp_path):
    _, x, y = ccpp_archive(tmp_path)
    d = load_uci("ccpp", tmp_path, download=False, standardized=False)
    assert d.x.shape == (60, 4) and np.allclose(d.x, x) and np.allclose(d.y, y)  # first sheet only, in order
    assert uci_feature_names("ccpp", tmp_path) == ("AT", "V", "AP", "RH")


def test_bike_from_latin1_csv(tmp_path):
    _, x, y = bike_archive(tmp_path)
    d = load_uci("bike", tmp_path, download=False, standardized=False)
    assert d.x.shape == (48, 15) and np.allclose(d.x, x) and np.allclose(d.y, y)


@pytest.mark.parametrize("zipped", [True, False])
def test_parkinsons_zip_or_extracted(tmp_path, zipped):
    raw, table = parkinsons_file()
    if zipped:
        _zip(_archive_path(tmp_path, "parkinsons"), {"parkinsons_updrs.data": raw, "parkinsons_updrs.names": b"."})
    else:
        folder = uci_folder("parkinsons", tmp_path)
        folder.mkdir(parents=True)
        (folder / "parkinsons_updrs.data").write_bytes(raw)
    d = load_uci("parkinsons", tmp_path, download=False, standardized=False)
    keep = [1, 2, 3] + list(range(6, 22))
    assert d.x.shape == (40, 19) and np.allclose(d.x, table[:, keep]) and np.allclose(d.y, table[:, 5])
    motor = load_uci("parkinsons", tmp_path, download=False, standardized=False, target="motor_UPDRS")
    assert np.allclose(motor.y, table[:, 4])


def test_sml2010_concatenates_both_files(tmp_path):
    _, values = sml_archive(tmp_path)
    d = load_uci("sml2010", tmp_path, download=False, standardized=False)
    assert d.x.shape == (42, 20)
    assert np.allclose(d.y, values[:, 0]) and np.allclose(d.x, values[:, 2:])
    s = load_uci("sml2010", tmp_path, download=False)  # all-zero columns survive standardisation
    assert np.all(np.isfinite(s.x))


def test_skillcraft_drops_rows_with_missing_values(tmp_path):
    _, kept = skillcraft_archive(tmp_path)
    d = load_uci("skillcraft", tmp_path, download=False, standardized=False)
    assert d.x.shape == (28, 18) and np.allclose(d.y, kept[:, 1]) and np.allclose(d.x, kept[:, 2:])


def test_missing_files_without_download(tmp_path):
    with pytest.raises(DatasetNotFoundError) as info:
        load_uci("ccpp", tmp_path, download=False)
    msg = str(info.value)
    assert str(uci_folder("ccpp", tmp_path)) in msg and "download=True" in msg and "Folds5x2_pp.xlsx" in msg


def test_network_is_disabled_in_tests(tmp_path):
    with pytest.raises(RuntimeError, match="network"):
        load_uci("skillcraft", tmp_path, download=True)
    assert not list(uci_folder("skillcraft", tmp_path).glob("*"))  # nothing half-written left behind


def test_download_caches_once(tmp_path, monkeypatch):
    data, kept = skillcraft_archive(None, write=False)
    calls = []

    def fake_urlopen(url, timeout=None):
        calls.append(url)
        return io.BytesIO(data)

    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    d = load_uci("skillcraft", download=True, standardized=False)  # default root: $PRIVFL_DATA (tmp, see conftest)
    assert calls == [UCI_DATASETS["skillcraft"].url]
    assert _archive_path(None, "skillcraft").read_bytes() == data
    assert np.allclose(d.y, kept[:, 1])
    load_uci("skillcraft", download=True)
    assert len(calls) == 1  # served from the cache the second time


def test_corrupt_archive_is_reported(tmp_path):
    path = _archive_path(tmp_path, "bike")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"<html>not found</html>")
    with pytest.raises(DatasetError, match="not a valid zip"):
        load_uci("bike", tmp_path, download=False)
    _zip(path, {"other.csv": b"a,b\n"})
    with pytest.raises(DatasetError, match="does not contain SeoulBikeData.csv"):
        load_uci("bike", tmp_path, download=False)


def test_make_federated_on_uci_uses_fedbnr_split(tmp_path):
    ccpp_archive(tmp_path, n=60)
    fd = make_federated("ccpp", 3, root=tmp_path, test_fraction=0.1, val_fraction=0.1)
    assert fd.partition == "sorted_chunk" and len(fd.test) == 6 and len(fd.val) == 6
    assert fd.client_sizes.sum() + len(fd.public) == 48 and fd.target_scale > 1.0  # 20 public: the minimum
    with pytest.raises(DatasetError, match="loader options"):
        make_federated("ccpp", 3, root=tmp_path, flatten=True)


def test_make_federated_on_uci_standardises_with_its_public_split_only(tmp_path):
    ccpp_archive(tmp_path, n=60)
    fd = make_federated("ccpp", 3, root=tmp_path, test_fraction=0.1)
    assert fd.info["standardize"] == "public" and len(fd.public) == 20
    raw = make_federated("ccpp", 3, root=tmp_path, test_fraction=0.1, standardize=None, public_size=20)
    ref, used = Standardizer.fit(raw.public), fd.info["standardizer"]
    assert np.array_equal(used.x_mean, ref.x_mean) and (used.y_mean, used.y_std) == (ref.y_mean, ref.y_std)
    # one extreme record added to client 0's raw data changes no other client's preprocessed records
    first = raw.train_parts[0]
    added = (np.concatenate([first.x, np.full((1, 4), 1e6, np.float32)]), np.concatenate([first.y, [-1e6]]))
    d2 = federated_from_arrays([added, *raw.train_parts[1:]], raw.test, name="ccpp", standardize="public",
                               public=raw.public)
    for k in (1, 2):
        assert d2.train_parts[k].x.tobytes() == fd.train_parts[k].x.tobytes()
        assert d2.train_parts[k].y.tobytes() == fd.train_parts[k].y.tobytes()
    assert d2.train_parts[0].subset(range(len(first))).x.tobytes() == fd.train_parts[0].x.tobytes()


def test_unknown_uci_name():
    with pytest.raises(DatasetError, match="skillcraft"):
        load_uci("boston", download=False)
