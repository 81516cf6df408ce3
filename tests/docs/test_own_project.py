"""README's "In your own project": the package installed the way it says (not editable, from this
checkout) registers the pytest plugin, README's first test passes in a scratch project with plain
``pytest``, and ``-p no:fsdp_testing`` turns the plugin off."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def _own_project_section() -> str:
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"^## In your own project\n(.*?)(?=^## |\Z)", readme, re.S | re.M)
    assert match, "README.md has no section 'In your own project'"
    return match.group(1)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This checkout, installed as README says (``pip install ./fsdp-testing``), into a folder
    of its own (its dependencies are this environment's)."""
    section = _own_project_section()
    assert "pip install ./fsdp-testing" in section
    # A copy of what the distribution is made of: pip builds in its source folder.
    source = tmp_path_factory.mktemp("source") / "fsdp-testing"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("fsdp_testing", "src"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    target = tmp_path_factory.mktemp("site")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    proc = subprocess.run(
        [*pip, "--no-deps", "--no-build-isolation", "--target", str(target), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return target


def _pytest(project: Path, site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
        # The installed copy comes first on the path, before this checkout's editable install.
        env={**os.environ, "PYTHONPATH": str(site)},
    )


def test_readmes_first_test_passes_with_plain_pytest(installed: Path, tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    first = re.search(r"^```python\n(.*?)^```", readme, re.S | re.M)
    assert first and "your first test is the one at the top of this page" in (
        _own_project_section().lower().replace("\n", " ")
    )
    (tmp_path / "test_first.py").write_text(first.group(1))
    (tmp_path / "conftest.py").write_text(
        "import fsdp_testing\n\n"
        "def pytest_report_header():\n"
        "    return f'fsdp_testing from {fsdp_testing.__file__}'\n"
    )
    proc = _pytest(tmp_path, installed)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "1 passed" in proc.stdout
    # The plugin came from the installed copy, registered by pip's entry point.
    assert f"fsdp_testing from {installed}" in proc.stdout

    proc = _pytest(tmp_path, installed, "-p", "no:fsdp_testing")
    assert proc.returncode == 1
    assert "fixture 'rank' not found" in proc.stdout
