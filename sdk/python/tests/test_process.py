"""The SDK in a real child process: stdio isolation and the plugin scaffold."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fakehost import Subprocess, make_context

STRAY_OUTPUT_RUNNER = r"""
import os, subprocess, sys
from switchboard_runner import serve

def run(ctx):
    print("stray print from run")
    sys.stdout.write("sys.stdout write\n")
    os.write(1, b"raw fd 1 write\n")
    subprocess.run([sys.executable, "-c", "print('child process print')"], check=True)
    # Reading stdin must not steal protocol lines either.
    ctx.emit.message_completed("stdin read " + repr(sys.stdin.read()))

serve(run)
"""


def test_stray_output_goes_to_stderr_not_onto_the_protocol_stream() -> None:
    p = Subprocess.python(STRAY_OUTPUT_RUNNER)
    p.host.run("r1")
    (item,) = p.host.results("r1")
    code, stderr = p.finish()
    assert code == 0
    assert item["data"]["message"]["content"] == "stdin read ''"
    for raw in p.host.raw_lines:
        json.loads(raw)  # every stdout line is protocol JSON
    for text in ("stray print from run", "sys.stdout write", "raw fd 1 write", "child process print"):
        assert text in stderr


def test_new_scaffolds_a_plugin_that_serves_runs(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "switchboard_runner", "new", "demo", "--dir", str(tmp_path), "--author", "tests"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "plugin:tests/demo/default" in out.stdout
    plugin = tmp_path / "demo"
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    manifest = tomllib.loads((plugin / "manifest.toml").read_text())
    assert manifest["plugin"] == {"author": "tests", "name": "demo", "version": "0.1.0"}
    (runner,) = manifest["runners"]
    assert runner["name"] == "default"
    assert runner["capabilities"] == {"streaming": True, "interrupt": True}
    execution = runner["execution"]
    assert execution["command"] == sys.executable and execution["args"] == ["runner.py"]
    assert execution["mode"] == "shared"

    # Refuses to overwrite, and refuses names that cannot be part of a runner id.
    again = subprocess.run([sys.executable, "-m", "switchboard_runner", "new", "demo", "--dir", str(tmp_path)], capture_output=True)
    assert again.returncode == 2
    bad = subprocess.run([sys.executable, "-m", "switchboard_runner", "new", "a/b", "--dir", str(tmp_path)], capture_output=True)
    assert bad.returncode == 2

    # The generated runner works as the manifest says: `command args` in the plugin directory,
    # with an empty environment.
    p = Subprocess([execution["command"], *execution["args"]], cwd=str(plugin), env={})
    p.host.run("r1", make_context("r1", "hello brave world"))
    got = p.host.results("r1")
    code, stderr = p.finish()
    assert code == 0, stderr
    assert [r["type"] for r in got] == ["message.delta"] * 3 + ["message.completed", "run.completed"]
    assert "".join(r["data"]["chunk"]["content"] for r in got[:3]) == "hello brave world"
