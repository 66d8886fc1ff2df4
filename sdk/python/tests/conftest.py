"""Fixtures of the end-to-end tests: one `switchboard dev` per session, with a plugins
directory holding the SDK probe runner (tests/runners/probe_runner.py) and the bare example
runner of docs/examples."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Iterator

import pytest
from sbhost import REPO, Switchboard, copy_open, make_root, open_to_others, python_for_runners

HERE = Path(__file__).resolve().parent
PROBE_ID = "plugin:switchboard-tests/py-probe/default"
PER_RUN_ID = "plugin:switchboard-tests/py-probe-per-run/default"
BARE_ID = "plugin:examples/bare-runner/default"

PROBE_MANIFEST = """\
[plugin]
author = "switchboard-tests"
name = "{name}"
version = "0.1.0"

[[runners]]
name = "default"
label = {{ en_US = "Python SDK probe" }}
capabilities = {{ streaming = true, interrupt = true }}

[runners.permissions]
history = ["page"]
storage = ["plugin"]
models = ["invoke", "stream"]

[runners.execution]
command = {python}
args = ["probe_runner.py"]
mode = "{mode}"
max_concurrency = 8
"""


def write_plugins(plugins: Path) -> None:
    python = python_for_runners()
    for name, mode in (("py-probe", "shared"), ("py-probe-per-run", "per_run")):
        probe = plugins / name
        probe.mkdir()
        (probe / "manifest.toml").write_text(PROBE_MANIFEST.format(name=name, mode=mode, python=json.dumps(python)))
        shutil.copy(HERE / "runners" / "probe_runner.py", probe / "probe_runner.py")
        for path in (probe, probe / "manifest.toml", probe / "probe_runner.py"):
            open_to_others(path)

    # docs/examples as committed; only an interpreter other than /usr/bin/python3 is swapped in.
    examples = REPO / "docs" / "examples"
    copy_open(examples / "bare_runner.py", plugins / "bare_runner.py")
    copy_open(examples / "bare-runner", plugins / "bare-runner")
    if not os.access("/usr/bin/python3", os.X_OK):
        manifest = plugins / "bare-runner" / "manifest.toml"
        manifest.write_text(manifest.read_text().replace('"/usr/bin/python3"', json.dumps(sys.executable)))


@pytest.fixture(scope="session")
def sb() -> Iterator[Switchboard]:
    root = make_root()
    plugins = root / "plugins"
    plugins.mkdir()
    open_to_others(plugins)
    write_plugins(plugins)
    host = Switchboard(root, plugins)
    try:
        host.start()
        yield host
    finally:
        host.stop()
        if os.environ.get("SB_PYTEST_KEEP"):
            print(f"\nswitchboard dev files kept in {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
