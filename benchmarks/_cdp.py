"""A page-load timer for Debian's Chromium over the DevTools pipe, with no instrumentation.

Playwright enables the Runtime domain on every page, and with it V8 captures a detailed stack
trace for each exception thrown: plotly.js throws and catches while it loads, and each capture
re-parses its 4.8 MB top-level function for source positions (about 0.5 s of main thread in a
trace). An ordinary browser does not pay that, so the render benchmark attaches the way only a
debugger would not: `--remote-debugging-pipe`, a script added with `Page`, the result read with
`Runtime.evaluate`, and neither `Runtime.enable` nor `Debugger.enable` ever sent.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from typing import Any

__all__ = ["ARGS", "Chromium"]

CHROMIUM = "/usr/bin/chromium"
# headless Chromium with nothing of its own on the network (also what Playwright launches with)
ARGS = [
    "--no-sandbox",
    "--headless",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
# records performance.now() (ms since navigation start) once every .chart holds a plot (checked
# at each DOM change: background targets get no animation frames)
WATCH = """(() => {
  const done = () => {
    const charts = document.querySelectorAll('.chart');
    return charts.length > 0 && [...charts].every((d) => d.querySelector('.main-svg'));
  };
  const watch = new MutationObserver(() => {
    if (done()) { window.__drawnAt = performance.now(); watch.disconnect(); }
  });
  watch.observe(document, {childList: true, subtree: true});
})();"""


class Chromium:
    """One headless Chromium; `render_ms(url)` loads a page in a fresh browser context."""

    def __init__(self, width: int = 1400, height: int = 1000) -> None:
        cmd_r, self._cmd = os.pipe()  # we write commands; Chromium reads them on fd 3
        self._res, res_w = os.pipe()  # Chromium writes results on fd 4
        self._profile = tempfile.TemporaryDirectory()

        def fds() -> None:  # in the child, before the fds outside pass_fds are closed
            a, b = os.dup(cmd_r), os.dup(res_w)  # neither may be clobbered by the other dup2
            os.dup2(a, 3)
            os.dup2(b, 4)

        self._proc = subprocess.Popen(
            [
                CHROMIUM,
                *ARGS,
                "--remote-debugging-pipe",
                f"--user-data-dir={self._profile.name}",
                "about:blank",
            ],
            preexec_fn=fds,
            pass_fds=(3, 4),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(cmd_r)
        os.close(res_w)
        self._next = 0
        self._buf = b""
        self._size = {"width": width, "height": height}

    def send(self, method: str, params: dict[str, Any] | None = None, session: str = "") -> Any:
        self._next += 1
        msg: dict[str, Any] = {"id": self._next, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._cmd, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def _read(self) -> dict[str, Any]:
        while b"\0" not in self._buf:
            chunk = os.read(self._res, 1 << 16)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def render_ms(self, url: str, timeout_s: float = 60.0) -> float:
        """Milliseconds from navigation start until every `.chart` on the page has drawn."""
        ctx = self.send("Target.createBrowserContext")["browserContextId"]  # a cold cache
        target = self.send(
            "Target.createTarget", {"url": "about:blank", "browserContextId": ctx, **self._size}
        )["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"
        ]
        try:
            self.send("Page.enable", {}, session)  # else the script below never runs
            self.send("Page.addScriptToEvaluateOnNewDocument", {"source": WATCH}, session)
            self.send("Page.navigate", {"url": url}, session)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                time.sleep(0.2)
                got = self.send(
                    "Runtime.evaluate",
                    {"expression": "window.__drawnAt || 0", "returnByValue": True},
                    session,
                )
                value = got.get("result", {}).get("value", 0)
                if value:
                    return float(value)
            raise TimeoutError(f"{url}: charts not drawn within {timeout_s} s")
        finally:
            self.send("Target.closeTarget", {"targetId": target})
            self.send("Target.disposeBrowserContext", {"browserContextId": ctx})

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except RuntimeError:
            pass
        self._proc.wait(timeout=10)
        os.close(self._cmd)
        os.close(self._res)
        self._profile.cleanup()
