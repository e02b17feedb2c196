"""Alerts: the run's spikes, non-finite steps, rollbacks, halts and failures, POSTed to webhooks.

    alerts = Alerter(["https://hooks.slack.com/services/...", "http://ops.local/hook"])
    alerts.notify({"kind": "spike", "run_id": ..., "step": ..., "message": ...})  # never blocks
    alerts.close(timeout=5)

The sink hands every event of an alerting kind to its `Alerter` (observatory/store/sink.py), so a
training run, the integrations and `spikewatch follow` all alert the same way. The store keeps
the event whatever the webhook does: alerting is a copy, on its own daemon thread, with a
bounded queue (a full queue drops the alert with a warning, never the training step's time).

Each URL gets one JSON body, Slack-compatible: `{"text": ...}` for Slack's incoming webhooks,
and for any other URL the same `text` plus the event's fields and a link to the run page
(`run_url`, from $SPIKEWATCH_DASHBOARD_URL, default http://127.0.0.1:8000). A failed POST
(refused, timed out, HTTP >= 400) is retried with exponential backoff (1 s, 2 s, 4 s, ... up to
`max_tries`); each URL is tried on its own. URLs come from `--alert-url` (repeatable) or
$SPIKEWATCH_ALERT_URLS (comma-separated).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import quote, urlparse

from spikewatch.observatory.findings import findings

__all__ = ["ALERT_KINDS", "ENV_URLS", "Alerter", "alert_body", "post"]

log = logging.getLogger(__name__)

ENV_URLS = "SPIKEWATCH_ALERT_URLS"
ENV_DASHBOARD = "SPIKEWATCH_DASHBOARD_URL"
ALERT_KINDS = ("spike", "nonfinite", "rollback", "halt", "failed", "stall", "slowdown")
_MARK = {k: f"[{k.replace('nonfinite', 'non-finite')}]" for k in (*ALERT_KINDS, "test")}


def urls_from(explicit: Iterable[str] = (), env: Mapping[str, str] | None = None) -> list[str]:
    """`--alert-url` values, else $SPIKEWATCH_ALERT_URLS; each must be an http(s) URL."""
    urls = [u.strip() for u in explicit if u.strip()]
    if not urls:
        raw = (env if env is not None else os.environ).get(ENV_URLS, "")
        urls = [u.strip() for u in raw.split(",") if u.strip()]
    for u in urls:
        if urlparse(u).scheme not in ("http", "https") or not urlparse(u).netloc:
            raise ValueError(f"alert URL must be http(s)://host/...: {u!r}")
    return urls


def run_url(run_id: str) -> str:
    base = os.environ.get(ENV_DASHBOARD, "http://127.0.0.1:8000").rstrip("/")
    return f"{base}/runs/{quote(run_id, safe='')}"


def alert_body(url: str, event: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON body for `url`: Slack's `{"text"}`, or the text with the event's fields."""
    kind = str(event.get("kind", "note"))
    run = str(event.get("run_id", "?"))
    where = f" at step {event['step']}" if event.get("step") is not None else ""
    link = run_url(run)
    what = f"{_MARK.get(kind, kind)} spikewatch: {kind} in run {run}{where}"
    found = findings(event.get("data") or {}) if kind == "rollback" else ""
    text = f"{what}: {event.get('message', '')}{f' ({found})' if found else ''} ({link})"
    if urlparse(url).netloc == "hooks.slack.com":
        return {"text": text}
    return {"text": text, **{k: v for k, v in event.items() if k != "text"}, "run_url": link}


def post(url: str, body: Mapping[str, Any], timeout: float = 5.0) -> None:
    """One POST of `body` as JSON; raises on a refused connection, a timeout or HTTP >= 400."""
    data = json.dumps(body, allow_nan=False, default=str).encode()
    req = urllib.request.Request(
        url, data=data, method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - http(s) checked
        resp.read()


class Alerter:
    """A daemon thread that POSTs alerts to every URL, retrying each with backoff."""

    def __init__(
        self,
        urls: Iterable[str],
        *,
        max_tries: int = 8,
        backoff_s: tuple[float, float] = (1.0, 60.0),
        timeout_s: float = 5.0,
        queue_size: int = 1000,
    ) -> None:
        self.urls = list(urls)
        self.max_tries = max_tries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self.sent = 0
        self.failed = 0
        self._q: queue.Queue[tuple[float, str, dict[str, Any], int] | None] = queue.Queue(
            maxsize=queue_size
        )
        self._retry: list[tuple[float, str, dict[str, Any], int]] = []  # (due, url, body, tries)
        self._idle = threading.Condition()
        self._pending = 0
        self._thread = threading.Thread(target=self._run, name="spikewatch-alerts", daemon=True)
        self._thread.start()

    def notify(self, event: Mapping[str, Any]) -> None:
        """Queue one alert per URL; returns at once (a full queue drops it, with a warning)."""
        for url in self.urls:
            item = (0.0, url, alert_body(url, event), 0)
            with self._idle:
                self._pending += 1
            try:
                self._q.put_nowait(item)
            except queue.Full:
                self._done()
                log.warning(
                    "alerts: queue full; dropped the %s alert for %s", event.get("kind"), url
                )

    def wait(self, timeout: float | None = None) -> bool:
        """Until every alert queued so far was delivered or given up; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float | None = 5.0) -> None:
        self.wait(timeout)
        self._q.put(None)
        self._thread.join(timeout)

    def _done(self) -> None:
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()

    def _run(self) -> None:
        while True:
            wait = None
            if self._retry:
                wait = max(0.0, min(r[0] for r in self._retry) - time.monotonic())
            try:
                item = self._q.get(timeout=wait)
            except queue.Empty:
                item = None
                now = time.monotonic()
                due = [r for r in self._retry if r[0] <= now]
                self._retry = [r for r in self._retry if r[0] > now]
                for r in due:
                    self._attempt(*r[1:])
                continue
            if item is None:
                return
            self._attempt(*item[1:])

    def _attempt(self, url: str, body: dict[str, Any], tries: int) -> None:
        try:
            post(url, body, self.timeout_s)
        except (OSError, urllib.error.URLError, ValueError) as e:
            tries += 1
            if tries >= self.max_tries:
                self.failed += 1
                log.error("alerts: %s gave up after %d tries (%s)", url, tries, e)
                self._done()
                return
            delay = min(self.backoff_s[0] * 2 ** (tries - 1), self.backoff_s[1])
            log.warning("alerts: %s failed (%s); retry %d in %.0fs", url, e, tries, delay)
            self._retry.append((time.monotonic() + delay, url, body, tries))
            return
        self.sent += 1
        self._done()
