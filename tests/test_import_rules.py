"""ARCHITECTURE.md fixes who may import whom; this test enforces it on the source tree."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
ALLOWED = {
    "accounting": set(),
    "secure_agg": set(),
    "mechanisms": {"accounting"},
    "privfl": {"accounting", "mechanisms", "secure_agg"},
    "experiments": {"privfl", "accounting", "mechanisms", "secure_agg"},
}
OWN = set(ALLOWED)


def imported_roots(path: pathlib.Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module.split(".")[0]


def test_packages_import_only_what_architecture_allows():
    violations = []
    for package, allowed in ALLOWED.items():
        for path in (ROOT / package).rglob("*.py"):
            for lineno, root in imported_roots(path):
                if root in OWN and root != package and root not in allowed:
                    violations.append(f"{path.relative_to(ROOT)}:{lineno} imports {root}")
    assert not violations, "imports that ARCHITECTURE.md forbids:\n" + "\n".join(violations)


def test_privacy_packages_know_nothing_of_torch():
    for package in ("accounting", "mechanisms", "secure_agg"):
        for path in (ROOT / package).rglob("*.py"):
            roots = {root for _, root in imported_roots(path)}
            assert "torch" not in roots, f"{path.relative_to(ROOT)} imports torch"


def test_nothing_reads_shared_folder():
    for package in list(ALLOWED) + ["tests"]:
        for path in (ROOT / package).rglob("*.py"):
            if path.name == "test_import_rules.py":
                continue
            assert "../shared" not in path.read_text(), f"{path.relative_to(ROOT)} refers to ../shared"


def test_the_rule_checker_sees_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import privfl\nfrom mechanisms.gaussian import GaussianMechanism\n")
    assert {root for _, root in imported_roots(bad)} == {"privfl", "mechanisms"}
