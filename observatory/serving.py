"""A dashboard server in a background thread: for the demo, the browser tests, the benchmarks
and the screenshots. The app is given (an ASGI object, or an import string with `factory`), so
this module imports no web code and the trainer may use it."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import uvicorn

__all__ = ["Served", "free_port", "serve_in_thread"]


@dataclass
class Served:
    server: uvicorn.Server
    thread: threading.Thread
    url: str

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def serve_in_thread(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    factory: bool = False,
    wait_s: float = 20.0,
) -> Served | None:
    """Start uvicorn on `app` in a daemon thread and wait until it listens; None if it did not
    start within `wait_s` (a port taken). uvicorn installs no signal handlers outside the main
    thread, so the caller's process (a training loop, pytest) keeps SIGINT and SIGTERM."""
    port = free_port(host) if port is None else port
    config = uvicorn.Config(app, factory=factory, host=host, port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="dashboard", daemon=True)
    thread.start()
    deadline = time.monotonic() + wait_s
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not server.started:
        server.should_exit = True
        return None
    return Served(server, thread, f"http://{host}:{port}")
