"""Alerts to a local HTTP receiver: delivered with the event's fields, retried after the
receiver was down, never holding up the caller while a webhook hangs, and the event always in
the store; `spikewatch alert-test`."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from spikewatch.observatory import store
from spikewatch.observatory.alerts import Alerter, alert_body
from spikewatch.observatory.serving import free_port
from spikewatch.observatory.store import db
from spikewatch.observatory.store.sink import open_run_sink


class Receiver:
    """A webhook on 127.0.0.1: keeps every JSON body; can be down, or hang until released."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.bodies: list[dict] = []
        self.got = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                receiver.release.wait(30)  # a hanging webhook, until released
                receiver.bodies.append(body)
                receiver.got.set()
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


@pytest.fixture
def receiver():
    r = Receiver()
    r.start()
    yield r
    r.release.set()
    r.stop()


def test_a_spike_in_a_run_reaches_the_webhook_with_its_fields(receiver, tmp_path: Path) -> None:
    sink = open_run_sink(tmp_path / "run", alert_urls=[receiver.url])
    sink.start_run("run")
    sink.log_metrics("run", 0, 5, {"train/loss": 9.0})
    sink.log_event("run", "spike", step=5, message="log-loss 12.0 robust sigmas above its level")
    sink.log_event("run", "note", step=5, message="not an alert")
    sink.close(timeout=30)
    (body,) = receiver.bodies  # the note is not an alert
    assert body["kind"] == "spike" and body["step"] == 5 and body["run_id"] == "run"
    assert body["text"].startswith("[spike] spikewatch: spike in run run at step 5: log-loss")
    assert body["run_url"].endswith("/runs/run") and body["run_url"] in body["text"]
    slack = alert_body("https://hooks.slack.com/services/T/B/X", {"kind": "halt", "run_id": "r"})
    assert list(slack) == ["text"] and "[halt]" in slack["text"]


def test_an_alert_is_retried_after_the_receiver_was_down(tmp_path: Path) -> None:
    down = Receiver()  # nothing listens on its port yet
    alerts = Alerter([down.url], backoff_s=(0.2, 0.4), max_tries=50)
    alerts.notify({"kind": "rollback", "run_id": "r", "step": 7, "message": "back to 0"})
    assert not alerts.wait(0.5)  # refused, and waiting for a retry
    down.start()
    try:
        assert alerts.wait(30)
        assert [b["kind"] for b in down.bodies] == ["rollback"] and alerts.sent == 1
    finally:
        alerts.close()
        down.stop()


def test_a_hanging_webhook_never_holds_up_the_run(receiver, tmp_path: Path) -> None:
    """While the webhook hangs (it answers only when released; the client would wait a
    minute), a run logs 200 steps and 4 spikes to the end, every event is in the store at
    once, and the alerts land once the webhook answers."""
    url = f"sqlite:///{tmp_path / 'sw.db'}"
    db.upgrade(url)
    receiver.release.clear()
    sink = open_run_sink(tmp_path / "run", url)
    sink.alerts = Alerter([receiver.url], timeout_s=60)
    sink.start_run("run")

    def train() -> None:
        for step in range(1, 201):
            sink.log_metrics("run", 0, step, {"train/loss": 1.0})
            if step % 50 == 0:
                sink.log_event("run", "spike", step=step, message=f"spike {step}")

    run = threading.Thread(target=train)
    run.start()
    run.join(20)  # a caller that waited on the webhook would still be in its first POST
    assert not run.is_alive() and receiver.bodies == []
    assert sink.flush(30)
    with store.session_factory(url)() as s:
        assert [e.step for e in store.events(s, run_id="run")] == [50, 100, 150, 200]
    receiver.release.set()
    assert sink.alerts.wait(60)
    sink.close(timeout=30)
    assert sorted(b["step"] for b in receiver.bodies) == [50, 100, 150, 200]


def test_alert_test_command(receiver, capsys) -> None:
    from spikewatch.trainer.cli import main

    assert main(["alert-test", receiver.url]) == 0
    assert receiver.bodies[0]["kind"] == "test" and "sent a test alert" in capsys.readouterr().out
    dead = Receiver()  # refused: a clear message and a non-zero exit
    assert main(["alert-test", dead.url]) == 1
    assert dead.url in capsys.readouterr().err
    assert main(["alert-test", "ftp://nowhere"]) == 2  # not an http(s) URL
