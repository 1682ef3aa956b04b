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


#: the layout's folders install under privfl (pyproject.toml's package-dir); an import names them as privfl.<folder>
MAPPED = {"accounting", "mechanisms", "secure_agg"}


def _root(module: str) -> str:
    """The layout package an absolute import name belongs to: privfl.accounting.ledger -> accounting."""
    parts = module.split(".")
    if parts[0] == "privfl" and len(parts) > 1 and parts[1] in MAPPED:
        return parts[1]
    return parts[0]


def imported_roots(path: pathlib.Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, _root(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "privfl":  # from privfl import accounting
                for alias in node.names:
                    yield node.lineno, alias.name if alias.name in MAPPED else "privfl"
            else:
                yield node.lineno, _root(node.module)


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
    bad.write_text("import privfl\nfrom privfl.mechanisms.gaussian import GaussianMechanism\n"
                   "import privfl.accounting.ledger\nfrom privfl import secure_agg\n")
    assert {root for _, root in imported_roots(bad)} == {"privfl", "mechanisms", "accounting", "secure_agg"}


def test_layout_folders_are_not_imported_as_top_level_modules():
    """The distribution has one import name: the layout's folders are privfl.accounting and the like, never a
    top-level ``accounting`` that would collide with other packages."""
    offenders = []
    for package in list(ALLOWED) + ["tests"]:
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
                offenders += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                              if n.split(".")[0] in MAPPED]
    assert not offenders, "import these as privfl.<package>:\n" + "\n".join(offenders)


def _privfl_modules_imported(path: pathlib.Path, root: pathlib.Path = ROOT):
    """Every privfl module name ``path`` imports, at any depth of the file (lazy imports count), relative imports
    resolved against the file's package (under ``root``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield node.lineno, module
            for alias in node.names:  # from privfl import runtime; from privfl.algorithms import fedbnr
                yield node.lineno, f"{module}.{alias.name}"


def _is_within(module: str, names) -> bool:
    return any(module == name or module.startswith(name + ".") for name in names)


#: what an algorithm may not import: the runtimes and the front ends that drive it
RUNTIME_MODULES = ("privfl.runtime", "privfl.phases", "privfl.flower", "privfl.cli", "privfl.compare", "privfl.api")


def test_algorithms_do_not_import_the_runtime():
    """An algorithm is its two halves (and, for a multi-phase one, its phases) and nothing else: any runtime
    (in-process, Flower) drives it, never the other way round."""
    violations = []
    for path in (ROOT / "privfl" / "algorithms").rglob("*.py"):
        for lineno, module in _privfl_modules_imported(path):
            if _is_within(module, RUNTIME_MODULES):
                violations.append(f"{path.relative_to(ROOT)}:{lineno} imports {module}")
    assert not violations, "algorithms import a runtime:\n" + "\n".join(violations)


def test_the_cli_knows_no_single_algorithm():
    """The CLI and ``compare`` build algorithms through the registry (privfl.algorithms.make_algorithm /
    ALGORITHMS), never by importing one algorithm's module."""
    allowed = {"privfl.algorithms", "privfl.algorithms.base"}
    registry = {f"privfl.algorithms.{name}" for name in ("ALGORITHMS", "make_algorithm", "algorithm_options",
                                                           "default_unit", "ClientOutput", "FederatedAlgorithm")}
    violations = []
    for name in ("cli.py", "compare.py"):
        path = ROOT / "privfl" / name
        for lineno, module in _privfl_modules_imported(path):
            if (_is_within(module, ["privfl.algorithms"]) and module not in allowed | registry
                    and not module.startswith("privfl.algorithms.base.")):
                violations.append(f"{path.relative_to(ROOT)}:{lineno} imports {module}")
    assert not violations, "the CLI imports a single algorithm:\n" + "\n".join(violations)


def test_the_new_rules_see_violations(tmp_path):
    """The two rules above catch a lazy import, a relative import and ``from package import module``."""
    algorithms = tmp_path / "privfl" / "algorithms"
    algorithms.mkdir(parents=True)
    bad = algorithms / "bad.py"
    bad.write_text("def f():\n    from privfl.runtime import Simulation\n"
                   "from ..phases import run_fedbnr\nfrom privfl import cli\nimport privfl.client_state\n")
    found = {m for _, m in _privfl_modules_imported(bad, tmp_path)}
    assert {m for m in found if _is_within(m, RUNTIME_MODULES)} == {"privfl.runtime", "privfl.runtime.Simulation",
                                                                     "privfl.phases", "privfl.phases.run_fedbnr",
                                                                     "privfl.cli"}
    cli = tmp_path / "privfl" / "cli.py"
    cli.write_text("def g():\n    from privfl.algorithms.fedbnr import run_fedbnr\n"
                   "from privfl.algorithms import fedbnn, make_algorithm\n")
    found = {m for _, m in _privfl_modules_imported(cli, tmp_path)}
    assert {"privfl.algorithms.fedbnr", "privfl.algorithms.fedbnn", "privfl.algorithms.make_algorithm"} <= found

