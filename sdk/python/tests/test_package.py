"""Packaging: the distribution builds as a wheel with the typed marker and the CLI."""

from __future__ import annotations

import email
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

SDK = Path(__file__).resolve().parents[1]


def test_wheel_builds_with_py_typed(tmp_path: Path) -> None:
    pytest.importorskip("setuptools")
    pytest.importorskip("wheel", reason="scripts/test installs `wheel` for an offline build")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(SDK)],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("switchboard_runner-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = email.message_from_bytes(z.read(info))
        entry_points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "switchboard_runner/py.typed" in names
    for module in ("__init__", "__main__", "api", "context", "emit", "errors", "results", "scaffold", "serve", "wire"):
        assert f"switchboard_runner/{module}.py" in names
    assert metadata["Name"] == "switchboard-runner"
    assert metadata["Requires-Python"] == ">=3.10"
    # Standard library only: the one requirement is the optional test extra.
    assert [r for r in metadata.get_all("Requires-Dist") or [] if "extra ==" not in r] == []
    assert "switchboard-runner = switchboard_runner.__main__:main" in entry_points
