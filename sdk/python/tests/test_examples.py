"""docs/examples: the bare runner (no SDK) answers through `switchboard dev`."""

from __future__ import annotations

from pathlib import Path

from conftest import BARE_ID
from sbhost import REPO, Switchboard


def test_bare_runner_is_short() -> None:
    assert len((REPO / "docs" / "examples" / "bare_runner.py").read_text().splitlines()) < 60


def test_bare_runner_answers_through_switchboard_dev(sb: Switchboard) -> None:
    sb.create_agent("bare", BARE_ID)
    events = sb.send("bare", "hello bare runner").rest()
    assert [e.event for e in events] == ["message.delta"] * 3 + ["message.completed", "run.completed"], events
    assert "".join(e.text for e in events[:3]) == "hello bare runner"
    assert events[3].text.startswith("hello bare runner (host ")


def test_bare_runner_manifest_is_the_committed_one(sb: Switchboard) -> None:
    committed = (REPO / "docs" / "examples" / "bare-runner" / "manifest.toml").read_text()
    used = (Path(sb.plugins) / "bare-runner" / "manifest.toml").read_text()
    assert used == committed or '"/usr/bin/python3"' in committed
