"""Control requests from the dashboard, read by the trainer without ever waiting on the store.

The dashboard stores a request as an event of kind "request" (`data`: `{"action": "rollback",
"to_step": N}` or `{"action": "stop"}`). A `RequestPoller` thread reads the run's requests every
`period_s` seconds; the trainer's callback takes the new ones between steps (`take()`, which
never blocks) and answers each with a note event that names the request's uid.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from spikewatch.observatory import store

__all__ = ["RequestPoller"]

log = logging.getLogger(__name__)


class RequestPoller:
    def __init__(self, url: str, run_id: str, period_s: float = 1.0) -> None:
        self.sessions = store.session_factory(url)
        self.run_id = run_id
        self.period_s = period_s
        self.seen: set[str] = set()
        self._new: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="requests", daemon=True)

    def start(self) -> RequestPoller:
        self._thread.start()
        return self

    def take(self) -> list[dict[str, Any]]:
        """New requests since the last call (uid, step, action, to_step), oldest first."""
        with self._lock:
            out, self._new = self._new, []
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self._poll()
            except Exception as e:  # the store may be away; the run goes on regardless
                log.debug("request poll failed: %s", e)

    def _poll(self) -> None:
        with self.sessions() as session:
            try:
                rows = store.events(session, run_id=self.run_id, kinds=["request"])
            except store.NotFoundError:
                return
        fresh = [r for r in rows if r.uid not in self.seen]
        with self._lock:
            for r in fresh:
                self.seen.add(r.uid)
                self._new.append({"uid": r.uid, "step": r.step, **r.data})
