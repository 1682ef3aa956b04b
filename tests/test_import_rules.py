"""ARCHITECTURE.md fixes who may import whom; this test enforces it on the source tree."""

import ast
import pathlib
import re
import subprocess
import sys

import pytest

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


#: folders of the checkout that are not the project's own files
_NOT_OURS = {".venv", ".git", "build", "dist", "runs", "__pycache__", ".pytest_cache"}

#: an import of a layout folder by its bare name inside code held in a string (``python -c``, a subprocess probe)
_BARE_IN_TEXT = re.compile(r"(?:^|[;\n]|\bpython3?\s+-c\s+['\"])\s*(?:import|from)\s+"
                           r"(accounting|mechanisms|secure_agg)\b|\s-m\s+(accounting|mechanisms|secure_agg)\b")


def project_python_files(root: pathlib.Path = ROOT):
    """Every Python file of the project, wherever it sits (packages, tests, experiments, scripts at the top)."""
    for path in sorted(root.rglob("*.py")):
        parts = set(path.relative_to(root).parts[:-1])
        if not parts & _NOT_OURS and not any(p.endswith(".egg-info") for p in parts):
            yield path


def bare_layout_imports(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """Where ``path`` loads a layout folder (accounting, mechanisms, secure_agg) under its bare top-level name: an
    import statement at any depth, ``importlib.import_module``/``__import__`` of a literal name, or code in a string
    literal (``python -c "import accounting"``, ``-m secure_agg``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    where = path.relative_to(root)
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__", "find_spec", "run_module"):
                names = [node.args[0].value]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for match in _BARE_IN_TEXT.finditer(node.value):
                found.append(f"{where}:{node.lineno} loads {match.group(1) or match.group(2)} in a string")
        found += [f"{where}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in MAPPED]
    return found


def test_layout_folders_are_not_imported_as_top_level_modules():
    """The distribution has one import name: the layout's folders are privfl.accounting and the like, never a
    top-level ``accounting`` (a second copy of the same modules, whose exception classes are not privfl's, and a
    name that would collide with other packages). Every Python file of the checkout is read."""
    offenders = [hit for path in project_python_files() if path.name != "test_import_rules.py"
                 for hit in bare_layout_imports(path)]
    assert not offenders, "import these as privfl.<package>:\n" + "\n".join(offenders)


def test_the_bare_import_checker_sees_every_form(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import secure_agg.client\nfrom accounting import ledger\nimport importlib\n"
                   "def f():\n    import mechanisms\n    importlib.import_module('secure_agg.server')\n"
                   "CODE = 'import sys; import accounting'\nARGS = ['python', '-m', 'x', ' -m secure_agg']\n"
                   "fine = 'privfl.secure_agg'\nfrom privfl.secure_agg import run_round\n")
    hits = bare_layout_imports(bad, tmp_path)
    assert len(hits) == 6, hits
    assert not bare_layout_imports(ROOT / "tests" / "test_packaging.py")  # find_spec(name) of a variable is fine


@pytest.mark.parametrize("package", ["secure_agg", "accounting", "mechanisms"])
def test_a_layout_folder_imported_from_the_checkout_is_the_privfl_package(package):
    """With the repository root on sys.path (``python`` started there, a script that inserts the working directory),
    ``import secure_agg`` finds the folder itself. It must hand out privfl's very modules, never a second copy."""
    probe = (
        "import sys, importlib, pkgutil\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        f"bare = importlib.import_module({package!r})\n"
        f"real = importlib.import_module('privfl.{package}')\n"
        "assert bare is real, (bare.__name__, real.__name__)\n"
        "for info in pkgutil.iter_modules(real.__path__):\n"
        f"    a = importlib.import_module({package!r} + '.' + info.name)\n"
        f"    b = importlib.import_module('privfl.{package}.' + info.name)\n"
        "    assert a is b, info.name\n"
        "copies = sorted(n for n, m in sys.modules.items() if m is not None\n"
        f"                and getattr(m, '__name__', n).startswith({package!r}))\n"
        "assert not copies, copies\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


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
RUNTIME_MODULES = ("privfl.runtime", "privfl.flower", "privfl.apps")


def test_algorithms_do_not_import_the_runtime():
    """An algorithm is its two halves (and, for a multi-phase one, its phases) and nothing else: any runtime
    (in-process, Flower) drives it, never the other way round."""
    violations = []
    for path in (ROOT / "privfl" / "algorithms").rglob("*.py"):
        for lineno, module in _privfl_modules_imported(path):
            if _is_within(module, RUNTIME_MODULES):
                violations.append(f"{path.relative_to(ROOT)}:{lineno} imports {module}")
    assert not violations, "algorithms import a runtime:\n" + "\n".join(violations)


#: what the non-private algorithm contract (privfl/algorithms/plain.py) may not import: anything that decides privacy
PRIVACY_MODULES = ("privfl.privacy", "privfl.core.channels", "privfl.core.release", "privfl.core.plan",
                   "privfl.core.public", "privfl.core.config", "privfl.accounting", "privfl.mechanisms",
                   "privfl.secure_agg", "privfl.algorithms.dpsgd_fedavg")


def test_the_non_private_algorithm_contract_knows_nothing_of_privacy():
    """A new algorithm is written against privfl/algorithms/plain.py alone: it imports no module that decides a
    privacy unit, clip, noise or charge, nor a runtime; the privacy wrappers (privfl/privacy/) may not import a runtime
    either (a runtime drives them)."""
    violations = []
    for lineno, module in _privfl_modules_imported(ROOT / "privfl" / "algorithms" / "plain.py"):
        if _is_within(module, PRIVACY_MODULES + RUNTIME_MODULES):
            violations.append(f"privfl/algorithms/plain.py:{lineno} imports {module}")
    for path in (ROOT / "privfl" / "privacy").rglob("*.py"):
        for lineno, module in _privfl_modules_imported(path):
            if _is_within(module, RUNTIME_MODULES):
                violations.append(f"{path.relative_to(ROOT)}:{lineno} imports {module}")
    assert not violations, "\n".join(violations)


def test_local_training_knows_nothing_of_privacy():
    """privfl/training/ is local training without privacy (the loop, the stacked executor, per-example terms): DP-SGD's
    lot, clip and noise live in privfl/privacy/record_level.py, which builds on it, never the other way round."""
    violations = []
    for path in (ROOT / "privfl" / "training").rglob("*.py"):
        for lineno, module in _privfl_modules_imported(path):
            if _is_within(module, PRIVACY_MODULES + RUNTIME_MODULES):
                violations.append(f"{path.relative_to(ROOT)}:{lineno} imports {module}")
    assert not violations, "\n".join(violations)


def test_the_cli_knows_no_single_algorithm():
    """The CLI and ``compare`` build algorithms through the registry (privfl.algorithms.make_algorithm /
    ALGORITHMS), never by importing one algorithm's module."""
    allowed = {"privfl.algorithms", "privfl.algorithms.base"}
    registry = {f"privfl.algorithms.{name}" for name in ("ALGORITHMS", "make_algorithm", "algorithm_options",
                                                           "algorithm_defaults", "default_unit",
                                                           "user_training_options", "ClientOutput",
                                                           "FederatedAlgorithm")}
    violations = []
    for name in ("cli.py", "compare.py"):
        path = ROOT / "privfl" / "apps" / name
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
    bad.write_text("def f():\n    from privfl.runtime.engine import Simulation\n"
                   "from ..runtime.phases import run_fedbnr\nfrom privfl.apps import cli\nimport privfl.client_state\n")
    found = {m for _, m in _privfl_modules_imported(bad, tmp_path)}
    assert {m for m in found if _is_within(m, RUNTIME_MODULES)} == {
        "privfl.runtime.engine", "privfl.runtime.engine.Simulation", "privfl.runtime.phases",
        "privfl.runtime.phases.run_fedbnr", "privfl.apps", "privfl.apps.cli"}
    (tmp_path / "privfl" / "apps").mkdir()
    cli = tmp_path / "privfl" / "apps" / "cli.py"
    cli.write_text("def g():\n    from privfl.algorithms.fedbnr import run_fedbnr\n"
                   "from privfl.algorithms import fedbnn, make_algorithm\n")
    found = {m for _, m in _privfl_modules_imported(cli, tmp_path)}
    assert {"privfl.algorithms.fedbnr", "privfl.algorithms.fedbnn", "privfl.algorithms.make_algorithm"} <= found



def privfl_import_graph(root: pathlib.Path = ROOT) -> dict[str, dict[str, int]]:
    """{module: {privfl module it imports: the line of the first such import}} for every module under
    ``root/privfl``: imports at any depth of the file, absolute or relative; ``from X import Y`` is an edge to X and,
    where X.Y is a module, to X.Y. A package is its ``__init__.py``."""
    paths = {}
    for path in sorted((root / "privfl").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in paths.items():
        edges = {}
        for lineno, module in _privfl_modules_imported(path, root):
            if module in paths and module != name:
                edges.setdefault(module, lineno)
        graph[name] = edges
    return graph


def _reachable(graph, start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for module in graph[todo.pop()]:
            if module not in seen:
                seen.add(module)
                todo.append(module)
    return seen


def import_cycles(graph) -> list[list[str]]:
    """The strongly connected components of ``graph`` that hold a cycle (two modules or more, each reaching the
    other), each sorted, in order of their first module."""
    reach = {module: _reachable(graph, module) for module in graph}
    cycles, placed = [], set()
    for module in sorted(graph):
        if module in placed or module not in reach[module]:
            continue
        component = sorted(other for other in reach[module] if module in reach[other])
        placed.update(component)
        cycles.append(component)
    return cycles


def _module_path(module: str, root: pathlib.Path = ROOT) -> str:
    """The file of a module of :func:`privfl_import_graph`, relative to ``root``."""
    path = root.joinpath(*module.split("."))
    return str((path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).relative_to(root))


def describe_cycles(graph, cycles, root: pathlib.Path = ROOT) -> str:
    """Each cycle's modules and the imports that close it (``privfl.a -> privfl.b (privfl/a.py:12)``)."""
    lines = []
    for component in cycles:
        lines.append(" <-> ".join(component))
        for module in component:
            where = _module_path(module, root)
            lines += [f"    {module} -> {target} ({where}:{lineno})"
                      for target, lineno in sorted(graph[module].items()) if target in component]
    return "\n".join(lines)


def test_privfl_modules_import_no_cycle():
    """The modules of privfl import one another in layers: no module reaches itself through its imports, lazy ones
    inside functions included (a cycle is a shared idea with two homes; give it one, in the lower module)."""
    graph = privfl_import_graph()
    assert sum(map(len, graph.values())) > len(graph), "the import graph is nearly empty: is ROOT the checkout?"
    cycles = import_cycles(graph)
    assert not cycles, "privfl modules that import one another:\n" + describe_cycles(graph, cycles)


def test_the_cycle_checker_sees_a_cycle(tmp_path):
    """Two modules that import each other, one lazily by its absolute name, the other by ``from . import module``."""
    package = tmp_path / "privfl"
    package.mkdir()
    (package / "a.py").write_text("def f():\n    from privfl.b import g\n    return g\n")
    (package / "b.py").write_text("from . import a\n\ndef g():\n    return a\n")
    graph = privfl_import_graph(tmp_path)
    assert graph == {"privfl.a": {"privfl.b": 2}, "privfl.b": {"privfl.a": 1}}
    cycles = import_cycles(graph)
    assert cycles == [["privfl.a", "privfl.b"]]
    text = describe_cycles(graph, cycles, tmp_path)
    assert "privfl.a -> privfl.b (privfl/a.py:2)" in text and "privfl.b -> privfl.a (privfl/b.py:1)" in text
