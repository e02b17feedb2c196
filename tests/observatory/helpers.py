"""Test helpers: a TCP proxy that can play a dead database, and a rollup consistency check."""

from __future__ import annotations

import socket
import threading

from sqlalchemy import Engine, text

from observatory.models import BLOCK_LEVELS


class Proxy:
    """Forwards 127.0.0.1:<port> to a target; `stop()` closes every connection and the port."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = _free_port()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._server: socket.socket | None = None

    def start(self) -> None:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", self.port))
        srv.listen(16)
        self._server = srv
        threading.Thread(target=self._accept, args=(srv,), daemon=True).start()

    def stop(self) -> None:
        """Refuse new connections and cut the open ones (the database 'goes away')."""
        if self._server is not None:
            try:
                self._server.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() on Linux
            except OSError:
                pass
            self._server.close()
            self._server = None
        with self._lock:
            for s in self._socks:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
            self._socks.clear()

    def _accept(self, srv: socket.socket) -> None:
        while True:
            try:
                client, _ = srv.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            with self._lock:
                self._socks += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def assert_blocks_consistent(engine: Engine) -> None:
    """Every rollup block agrees with the points it summarises (count, NaNs, min, max)."""
    with engine.connect() as conn:
        for level, size in BLOCK_LEVELS.items():
            want = conn.execute(
                text(
                    f"SELECT series_id, step / {size} AS b, COUNT(*), COUNT(*) - COUNT(value), "
                    f"MIN(value), MAX(value) FROM points GROUP BY series_id, step / {size} "
                    "ORDER BY 1, 2"
                )
            ).all()
            got = conn.execute(
                text(
                    "SELECT series_id, block, n, n_nan, min_value, max_value FROM point_blocks "
                    f"WHERE level = {level} ORDER BY 1, 2"
                )
            ).all()
            assert [tuple(r) for r in got] == [tuple(r) for r in want], f"level {level}"


def count(engine: Engine, sql: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(sql)).scalar_one())
