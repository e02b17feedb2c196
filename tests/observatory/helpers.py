"""Test helpers: a TCP proxy that can play a dead database, and reads of the stored windows."""

from __future__ import annotations

import math
import socket
import threading

from sqlalchemy import Engine, text

from spikewatch.observatory.store.chunks import WINDOW, decode


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


def stored_points(engine: Engine) -> list[tuple[int, int, float]]:
    """Every stored value as (series id, step, value), decoded from its window, in order."""
    out = []
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT series_id, win, first_step, last_step, n, steps, vals FROM point_windows "
                "ORDER BY series_id, win"
            )
        )
        for sid, win, first, last, n, steps, vals in rows:
            st, v = decode(win, first, last, n, steps, vals)
            out += [(sid, s, x) for s, x in zip(st.tolist(), v.tolist(), strict=True)]
    return out


def assert_windows_consistent(engine: Engine) -> None:
    """Every window's stored summary agrees with its values, recomputed here in plain Python:
    count, NaNs, first NaN, min and max with the earliest step of each, first and last step."""
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT * FROM point_windows ORDER BY series_id, win")).mappings()
        for r in rows:
            st, v = decode(r["win"], r["first_step"], r["last_step"], r["n"], r["steps"], r["vals"])
            steps, vals = st.tolist(), v.tolist()
            assert steps == sorted(set(steps)) and len(steps) == r["n"]
            assert {s // WINDOW for s in steps} == {r["win"]}
            assert (steps[0], steps[-1]) == (r["first_step"], r["last_step"])
            nans = [s for s, x in zip(steps, vals, strict=True) if math.isnan(x)]
            assert (r["n_nan"], r["nan_step"]) == (len(nans), nans[0] if nans else None)
            real = [(x, s) for s, x in zip(steps, vals, strict=True) if not math.isnan(x)]
            lo = min(real) if real else (None, None)
            hi = max(real, key=lambda p: (p[0], -p[1])) if real else (None, None)
            assert (r["min_value"], r["min_step"]) == lo, r
            assert (r["max_value"], r["max_step"]) == hi, r


def count(engine: Engine, sql: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(sql)).scalar_one())
