"""The distribution installs one top-level package, ``privfl``: the layout's accounting/, mechanisms/ and secure_agg/
folders install as ``privfl.accounting`` and the like (pyproject.toml's package-dir), so they cannot collide with
other distributions' generic top-level modules."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "privfl", "accounting", "mechanisms", "secure_agg")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    """A wheel built from a copy of the sources (the build leaves nothing in the checkout)."""
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif path.exists():
            shutil.copy(path, src / name)
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=240)
    if proc.returncode != 0 and "No module named" in proc.stderr and "setuptools" in proc.stderr:
        pytest.skip("setuptools is not installed in this environment")
    assert proc.returncode == 0, proc.stderr
    (path,) = out.glob("privfl-*.whl")
    return path


def test_wheel_has_exactly_one_top_level_package(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"privfl"}
    for package in ("accounting", "mechanisms", "secure_agg"):
        assert f"privfl/{package}/__init__.py" in names
    assert "privfl/accounting/accountants/__init__.py" in names
    assert "privfl/py.typed" in names


def test_installed_wheel_imports_only_under_privfl(wheel, tmp_path):
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                           str(wheel)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "import importlib.util as u\n"
        "for name in ('accounting', 'mechanisms', 'secure_agg'):\n"
        "    assert u.find_spec(name) is None, name\n"
        "import privfl.accounting.calibration as c, privfl.secure_agg, privfl.mechanisms\n"
        "assert c.__file__.startswith(sys.argv[1]), c.__file__\n"
        "assert 'torch' not in sys.modules, 'calibration must not need torch'\n"
        "print(c.calibrate(1.0, 1e-5, 10).noise_multipliers)\n"
    )
    # -I: no current directory (the checkout) and no user site on the path
    proc = subprocess.run([sys.executable, "-I", "-c", probe, str(target)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "update" in proc.stdout


def test_core_dependencies_leave_training_and_plots_to_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {req.split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip().lower()
            for req in project["dependencies"]}
    assert not core & {"torch", "torchvision", "opacus", "matplotlib", "mlxtend", "flwr"}
    extras = project["optional-dependencies"]
    assert any(r.startswith("torch") for r in extras["train"])
    assert any(r.startswith("flwr") for r in extras["flower"])
