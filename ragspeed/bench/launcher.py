"""Start a real `ragspeed serve` (or another server module) in a child process and wait until
it is ready.

Used by the tests, the benchmarks and the A/B runner: everything talks to real servers over HTTP.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`with ServerProcess(["--engine", "transformers"]) as server: server.url`; `command` runs
    another server that takes `--host` and `--port` and answers `GET /healthz`."""

    def __init__(
        self,
        args: list[str],
        *,
        port: int | None = None,
        env: dict[str, str] | None = None,
        ready_timeout_s: float = 180.0,
        command: tuple[str, ...] = ("-m", "ragspeed", "serve"),
    ):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._args = ["--host", "127.0.0.1", "--port", str(self.port), *args]
        self._env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self._ready_timeout_s = ready_timeout_s
        self._command = command
        self._log = tempfile.NamedTemporaryFile("w+b", prefix="ragspeed-server-", suffix=".log", delete=False)
        self.process: subprocess.Popen | None = None

    @property
    def log_path(self) -> Path:
        return Path(self._log.name)

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_bytes()[-num_chars:].decode("utf-8", "replace")

    def start(self) -> ServerProcess:
        self.process = subprocess.Popen(
            [sys.executable, *self._command, *self._args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self._env,
        )
        deadline = time.monotonic() + self._ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{' '.join(self._command)} exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            try:
                response = httpx.get(f"{self.url}/healthz", timeout=2.0)
                if response.status_code == 200:
                    return self
                if response.json().get("status") == "failed":
                    raise RuntimeError(f"engine failed to start: {response.text}\n{self.log_tail()}")
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(
            f"{' '.join(self._command)} not ready after {self._ready_timeout_s} s:\n{self.log_tail()}"
        )

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
