"""The root ``conftest.py`` collects the suite's longest files first (``LONGEST_FIRST``), whole
files at a time, each keeping its own order; ``scripts/test.sh``'s xdist workers take them so."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _root_conftest():
    spec = importlib.util.spec_from_file_location("_root_conftest", ROOT / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_file_it_names_exists_once():
    names = _root_conftest().LONGEST_FIRST
    assert len(set(names)) == len(names), "a file is named twice"
    missing = [name for name in names if not (ROOT / name).is_file()]
    assert not missing, f"LONGEST_FIRST names files that are gone (renamed?): {missing}"


def test_named_files_run_first_in_its_order_and_each_file_keeps_its_own(pytester):
    conftest = (ROOT / "conftest.py").read_text()
    pytester.makeconftest(conftest + '\nLONGEST_FIRST = ("test_c.py", "test_b.py")\n')
    for name in ("a", "b", "c"):
        pytester.makepyfile(
            **{
                f"test_{name}": "\n".join(
                    f"def test_{name}{i}():\n    pass\n"
                    for i in (2, 1, 3)  # not sorted
                )
            }
        )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--collect-only", "-q")
    ids = [line for line in result.outlines if "::" in line]
    assert ids == [
        f"test_{name}.py::test_{name}{i}" for name in ("c", "b", "a") for i in (2, 1, 3)
    ], result.outlines
