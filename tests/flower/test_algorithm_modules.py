"""The run config's ``algorithm-modules`` comes from whoever starts the run: a ClientApp imports only what the app
brought (a module the app module imported, or a .py file beside the app module that ``write_app`` wrote), never a
script elsewhere on the SuperNode's disk, nor an installed module the app never imported."""

import json
import sys

import pytest

pytest.importorskip("flwr")

from privfl.errors import ConfigurationError  # noqa: E402
from privfl.flower.app import APP_MODULE, MODULES_KEY, import_algorithm_modules  # noqa: E402


def test_a_script_outside_an_app_folder_is_refused_and_not_run(tmp_path):
    marker = tmp_path / "ran"
    script = tmp_path / "elsewhere" / "payload_script.py"
    script.parent.mkdir()
    script.write_text(f"open({str(marker)!r}, 'w').write('yes')\n")
    with pytest.raises(ConfigurationError, match="refusing to import it"):
        import_algorithm_modules({MODULES_KEY: json.dumps([str(script)])})
    assert not marker.exists() and "payload_script" not in sys.modules


def test_an_installed_module_the_app_never_imported_is_refused():
    name = "this_module_is_not_loaded_xyz"
    with pytest.raises(ConfigurationError, match="refusing to import it"):
        import_algorithm_modules({MODULES_KEY: json.dumps([name])})


def test_a_file_beside_the_app_module_is_imported_once(tmp_path):
    (tmp_path / f"{APP_MODULE}.py").write_text("")
    module = tmp_path / "own_algorithm_for_the_test.py"
    module.write_text("LOADED = True\n")
    try:
        import_algorithm_modules({MODULES_KEY: json.dumps([str(module)])})
        assert sys.modules["own_algorithm_for_the_test"].LOADED
        module.write_text("raise RuntimeError('imported twice')\n")
        import_algorithm_modules({MODULES_KEY: json.dumps([str(module)])})  # already loaded: not run again
    finally:
        sys.modules.pop("own_algorithm_for_the_test", None)
    with pytest.raises(ConfigurationError, match="not a JSON list"):
        import_algorithm_modules({MODULES_KEY: "{}"})
