"""A small reader for the cell values of one sheet of an .xlsx workbook (Office Open XML, ECMA-376), using only the
standard library, so that CCPP's ``Folds5x2_pp.xlsx`` loads without openpyxl or pandas.

It reads values only: numbers, shared strings, inline strings, formula results and booleans; no styles or dates.
"""

from __future__ import annotations

import io
import posixpath
import re
import zipfile
import xml.etree.ElementTree as ET

from privfl.data.errors import DatasetError

_MAIN = "{http://schemas.openxmlformats.org/spreadsheetml/2006/main}"
_REL_ID = "{http://schemas.openxmlformats.org/officeDocument/2006/relationships}id"
_PKG_REL = "{http://schemas.openxmlformats.org/package/2006/relationships}"
_CELL_REF = re.compile(r"^([A-Z]+)(\d+)$")


def _column_index(letters: str) -> int:
    idx = 0
    for ch in letters:
        idx = idx * 26 + (ord(ch) - ord("A") + 1)
    return idx - 1


def _text(node: ET.Element) -> str:
    """All ``<t>`` text under a shared-string or inline-string item (plain or rich runs), phonetic runs excluded."""
    parts = []
    for child in node:
        if child.tag == _MAIN + "t":
            parts.append(child.text or "")
        elif child.tag == _MAIN + "r":
            parts.extend(t.text or "" for t in child.iter(_MAIN + "t"))
    return "".join(parts)


def _sheet_path(zf: zipfile.ZipFile, sheet: int | str) -> str:
    workbook = ET.fromstring(zf.read("xl/workbook.xml"))
    sheets = list(workbook.iter(_MAIN + "sheet"))
    if not sheets:
        raise DatasetError("the workbook lists no sheets")
    if isinstance(sheet, str):
        matches = [s for s in sheets if s.get("name") == sheet]
        if not matches:
            raise DatasetError(f"no sheet named {sheet!r}; sheets: {[s.get('name') for s in sheets]}")
        chosen = matches[0]
    else:
        if not 0 <= sheet < len(sheets):
            raise DatasetError(f"sheet index {sheet} out of range ({len(sheets)} sheets)")
        chosen = sheets[sheet]
    rel_id = chosen.get(_REL_ID)
    rels = ET.fromstring(zf.read("xl/_rels/workbook.xml.rels"))
    for rel in rels.iter(_PKG_REL + "Relationship"):
        if rel.get("Id") == rel_id:
            target = rel.get("Target", "")
            return target.lstrip("/") if target.startswith("/") else posixpath.normpath(posixpath.join("xl", target))
    raise DatasetError(f"sheet relationship {rel_id!r} not found in the workbook")


def read_xlsx(source: str | bytes | io.IOBase, sheet: int | str = 0) -> list[list]:
    """Rows of one sheet as lists of cell values (float, str, bool or None for an empty cell), rows padded to the
    same width. ``source`` is a path, the file's bytes, or a binary file object."""
    if isinstance(source, (bytes, bytearray)):
        source = io.BytesIO(source)
    try:
        zf = zipfile.ZipFile(source)
    except zipfile.BadZipFile as err:
        raise DatasetError("not an .xlsx file (not a zip archive)") from err
    with zf:
        names = set(zf.namelist())
        shared: list[str] = []
        if "xl/sharedStrings.xml" in names:
            sst = ET.fromstring(zf.read("xl/sharedStrings.xml"))
            shared = [_text(si) for si in sst.iter(_MAIN + "si")]
        path = _sheet_path(zf, sheet)
        if path not in names:
            raise DatasetError(f"sheet part {path} missing from the workbook")
        root = ET.fromstring(zf.read(path))
    rows: dict[int, dict[int, object]] = {}
    next_row = 0
    for row in root.iter(_MAIN + "row"):
        r = int(row.get("r")) - 1 if row.get("r") else next_row
        next_row = r + 1
        cells: dict[int, object] = {}
        next_col = 0
        for c in row.iter(_MAIN + "c"):
            ref = c.get("r")
            m = _CELL_REF.match(ref) if ref else None
            col = _column_index(m.group(1)) if m else next_col
            next_col = col + 1
            kind = c.get("t", "n")
            v = c.find(_MAIN + "v")
            if kind == "inlineStr":
                node = c.find(_MAIN + "is")
                value = _text(node) if node is not None else ""
            elif v is None or v.text is None:
                value = None
            elif kind == "s":
                value = shared[int(v.text)]
            elif kind in ("str", "e"):
                value = v.text
            elif kind == "b":
                value = v.text.strip() == "1"
            else:
                value = float(v.text)
            cells[col] = value
        rows[r] = cells
    if not rows:
        return []
    width = max((max(c) + 1 for c in rows.values() if c), default=0)
    return [[rows.get(r, {}).get(c) for c in range(width)] for r in range(max(rows) + 1)]


__all__ = ["read_xlsx"]
