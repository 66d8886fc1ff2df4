"""`switchboard dev` in a subprocess, and a small HTTP client for it (standard library only)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator, Mapping

REPO = Path(__file__).resolve().parents[3]
TIMEOUT = 30.0


def switchboard_binary() -> Path:
    """``SWITCHBOARD_BIN``, else ``target/debug/switchboard`` (built by ``cargo build --bins``)."""
    return Path(os.environ.get("SWITCHBOARD_BIN", REPO / "target" / "debug" / "switchboard"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def runner_user_switch() -> bool:
    """Whether the worker will run runners as another user (``nobody``): it does when it
    runs as root."""
    return os.geteuid() == 0


def open_to_others(path: Path) -> None:
    """``chmod o+rx`` on ``path`` (a directory or a file), so the runner user can use it."""
    mode = path.stat().st_mode
    path.chmod(mode | stat.S_IROTH | (stat.S_IXOTH if path.is_dir() or mode & stat.S_IXUSR else 0))


def check_reachable(path: Path, what: str) -> None:
    """Fails with an explanation if another user cannot reach ``path`` (read it and traverse
    every directory above it). Only matters when the worker switches users."""
    if not runner_user_switch():
        return
    target = Path(os.path.abspath(path))
    for step in [*reversed(target.parents), target]:
        mode = step.stat().st_mode
        if step.is_dir() and not mode & stat.S_IXOTH or step == target and not mode & stat.S_IROTH:
            raise RuntimeError(
                f"{what} {path} is not reachable by the runner user (nobody): {step} is mode "
                f"{stat.filemode(mode)}. The worker runs runners as `nobody` when it runs as root; "
                "use an interpreter and a checkout that others can read (scripts/test creates "
                "target/python-venv from /usr/bin/python3)."
            )


def python_for_runners() -> str:
    """The interpreter the test plugins run: this one (the venv with switchboard-runner),
    checked to be usable by the runner user."""
    import site

    import switchboard_runner

    check_reachable(Path(sys.executable), "the Python interpreter")
    check_reachable(Path(os.path.realpath(sys.executable)), "the Python interpreter")
    if (Path(sys.prefix) / "pyvenv.cfg").is_file():
        check_reachable(Path(sys.prefix) / "pyvenv.cfg", "the virtual environment")
    for packages in site.getsitepackages():
        if Path(packages).is_dir():
            check_reachable(Path(packages), "the site-packages directory")
    check_reachable(Path(switchboard_runner.__file__), "the switchboard_runner package")
    return sys.executable


class Event:
    """One SSE frame of a run stream: ``event`` (the result type), ``data`` (the item)."""

    def __init__(self, event: str, data: Any, id: str | None) -> None:
        self.event = event
        self.data = data
        self.id = id

    @property
    def run_id(self) -> str | None:
        return self.data.get("run_id") if isinstance(self.data, dict) else None

    @property
    def text(self) -> str:
        """The text of a message.delta / message.completed item."""
        payload = self.data.get("data", {}) if isinstance(self.data, dict) else {}
        part = payload.get("chunk") or payload.get("message") or {}
        content = part.get("content")
        return content if isinstance(content, str) else ""

    def __repr__(self) -> str:
        return f"Event({self.event!r}, {self.data!r})"


class Stream:
    """A run's SSE stream (the answer of ``POST /v1/events?stream=true``)."""

    def __init__(self, response: Any) -> None:
        self._response = response
        self.events: list[Event] = []

    def __iter__(self) -> Iterator[Event]:
        event, ident = "message", None
        data: list[str] = []
        for raw in self._response:
            line = raw.decode("utf-8").rstrip("\r\n")
            if not line:
                if data:
                    text = "\n".join(data)
                    try:
                        value: Any = json.loads(text)
                    except ValueError:
                        value = text
                    frame = Event(event, value, ident)
                    self.events.append(frame)
                    yield frame
                    if event in ("run.completed", "run.failed", "error"):
                        return
                event, data, ident = "message", [], None
            elif line.startswith(":"):
                continue
            else:
                name, _, value_text = line.partition(":")
                value_text = value_text[1:] if value_text.startswith(" ") else value_text
                if name == "event":
                    event = value_text
                elif name == "data":
                    data.append(value_text)
                elif name == "id":
                    ident = value_text

    def next(self) -> Event:
        return next(iter(self))

    def rest(self) -> list[Event]:
        """Reads to the terminal item; returns every frame of the stream."""
        for _ in self:
            pass
        self._response.close()
        return self.events

    def terminal(self) -> Event:
        events = self.rest()
        assert events, "empty stream"
        return events[-1]


class Switchboard:
    """A running ``switchboard dev`` with its data dir, plugins dir and HTTP API."""

    def __init__(self, root: Path, plugins: Path) -> None:
        self.root = root
        self.plugins = plugins
        self.data_dir = root / "data"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = root / "switchboard.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.api_key = ""

    def start(self) -> None:
        binary = switchboard_binary()
        if not binary.is_file():
            raise RuntimeError(f"{binary} not found: build it with `cargo build --bins` (or set SWITCHBOARD_BIN)")
        env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD__")}
        # The runners' stderr is logged at info (target sb_worker::runner::stderr); the
        # print test reads it from this log.
        env["RUST_LOG"] = f"{env['RUST_LOG']},sb_worker::runner=info" if env.get("RUST_LOG") else "info"
        env["NO_COLOR"] = "1"
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [
                str(binary),
                "dev",
                "--data-dir",
                str(self.data_dir),
                "--http-addr",
                f"127.0.0.1:{self.port}",
                "--runners-dir",
                str(self.plugins),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.root,
            env=env,
        )
        log.close()
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"switchboard dev exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            key_file = self.data_dir / "api-key"
            if key_file.is_file() and self._ready():
                self.api_key = key_file.read_text().strip()
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"switchboard dev did not become ready:\n{self.log()[-4000:]}")
            time.sleep(0.1)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/readyz", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    # HTTP ------------------------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None, *, timeout: float = TIMEOUT) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.api_key}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{method} {path} -> {e.code}: {e.read().decode(errors='replace')}") from None
        return json.loads(raw) if raw else None

    def create_agent(self, name: str, runner_id: str, config: Mapping[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
        """An agent for ``runner_id`` answering events of bot ``name`` (its own scope)."""
        body = {"name": name, "runner_id": runner_id, "runner_config": dict(config or {}), "scope": {"bot_id": name}}
        body.update(fields)
        return dict(self.request("POST", "/v1/agents", body))

    def send(self, bot_id: str, text: str, conversation_id: str | None = None) -> Stream:
        """``POST /v1/events?stream=true`` with a ``message.received`` for ``bot_id``."""
        body = {
            "event_type": "message.received",
            "source": "api",
            "bot_id": bot_id,
            "conversation_id": conversation_id or f"{bot_id}-{time.monotonic_ns()}",
            "input": {"text": text},
        }
        req = urllib.request.Request(self.url + "/v1/events?stream=true", data=json.dumps(body).encode(), method="POST")
        req.add_header("Authorization", f"Bearer {self.api_key}")
        req.add_header("Content-Type", "application/json")
        return Stream(urllib.request.urlopen(req, timeout=TIMEOUT))

    def cancel(self, run_id: str, reason: str) -> Any:
        return self.request("POST", f"/v1/runs/{run_id}/cancel", {"reason": reason})


def make_root() -> Path:
    """A temporary directory the runner user can traverse (mkdtemp makes it 0700)."""
    root = Path(tempfile.mkdtemp(prefix="sb-pytest-"))
    open_to_others(root)
    return root


def copy_open(src: Path, dst: Path) -> None:
    """Copies a file or tree and opens it to others (``o+rx`` on dirs, ``o+r`` on files)."""
    if src.is_dir():
        shutil.copytree(src, dst)
        for path in [dst, *dst.rglob("*")]:
            open_to_others(path)
    else:
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
        open_to_others(dst)
