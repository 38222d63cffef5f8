"""A headless Chromium driven over the DevTools protocol, for page tests.

Debian's ``chromium`` (``scripts/bootstrap`` installs it) runs headless with
``--remote-debugging-port=0``; the port it took is read from the
``DevToolsActivePort`` file in its profile directory, and one page target
is driven over a websocket (``websocket-client``).  Every wait has a
deadline.  As root Chromium refuses to start without ``--no-sandbox``, so
that flag is added when the tests run as root (this sandbox and CI do).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import websocket


def chromium_path() -> str | None:
    """The Chromium binary, or None when it is not installed."""
    for name in ("chromium", "chromium-browser"):
        p = shutil.which(name)
        if p:
            return p
    return None


class CdpError(RuntimeError):
    pass


class Browser:
    """One headless Chromium process and a session on its first page."""

    def __init__(self, profile: Path, width: int = 1280, height: int = 1600,
                 timeout: float = 60) -> None:
        exe = chromium_path()
        if exe is None:
            raise CdpError("chromium is not installed (scripts/bootstrap installs it)")
        self.no_sandbox = os.geteuid() == 0
        profile.mkdir(parents=True, exist_ok=True)
        args = [exe, "--headless", "--disable-gpu", "--no-first-run",
                "--no-default-browser-check", "--disable-extensions",
                "--disable-background-networking", "--disable-sync",
                "--remote-debugging-port=0", f"--user-data-dir={profile}",
                f"--window-size={width},{height}", "about:blank"]
        if self.no_sandbox:
            args.insert(1, "--no-sandbox")
        self.log_path = profile / "chromium.log"
        self._log = open(self.log_path, "wb")
        # its own process group: close() ends Chromium's helper processes
        # (zygote, renderer) with it, by the group this object started
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.events: list[dict] = []
        self.dialogs: list[str] = []
        self._next_id = 0
        self.ws = None
        try:
            port = self._devtools_port(profile, timeout)
            url = self._page_ws(port, timeout)
            self.ws = websocket.create_connection(url, timeout=timeout,
                                                  suppress_origin=True)
            self.call("Page.enable")
            self.call("Runtime.enable")
            self.call("Network.enable")
        except BaseException:
            self.close()
            raise

    def _devtools_port(self, profile: Path, timeout: float) -> int:
        f = profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise CdpError(f"chromium exited with {self.proc.returncode}: "
                               + self.log_path.read_text(errors="replace")[-2000:])
            try:
                first = f.read_text().splitlines()[0]
                if first:
                    return int(first)
            except (FileNotFoundError, IndexError, ValueError):
                pass
            time.sleep(0.05)
        raise CdpError(f"no DevToolsActivePort within {timeout}s")

    def _page_ws(self, port: int, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list",
                                        timeout=timeout) as r:
                for t in json.load(r):
                    if t.get("type") == "page" and t.get("webSocketDebuggerUrl"):
                        return t["webSocketDebuggerUrl"]
            time.sleep(0.05)
        raise CdpError(f"no page target within {timeout}s")

    # ---- protocol ---------------------------------------------------------

    def _on_event(self, msg: dict) -> None:
        self.events.append(msg)
        if msg.get("method") == "Page.javascriptDialogOpening":
            # the page's confirm() blocks the call that opened it: accept it
            # here, while that call waits for its answer
            self.dialogs.append(msg["params"].get("message", ""))
            self._send("Page.handleJavaScriptDialog", {"accept": True})

    def _send(self, method: str, params: dict | None) -> int:
        self._next_id += 1
        self.ws.send(json.dumps({"id": self._next_id, "method": method,
                                 "params": params or {}}))
        return self._next_id

    def call(self, method: str, params: dict | None = None,
             timeout: float = 30) -> dict:
        """Sends one command and returns its result (events seen meanwhile
        are kept in self.events)."""
        want = self._send(method, params)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CdpError(f"{method}: no answer within {timeout}s")
            self.ws.settimeout(left)
            msg = json.loads(self.ws.recv())
            if "method" in msg:
                self._on_event(msg)
                continue
            if msg.get("id") != want:
                continue  # the answer to a dialog's handleJavaScriptDialog
            if "error" in msg:
                raise CdpError(f"{method}: {msg['error']}")
            return msg.get("result", {})

    def evaluate(self, expr: str, timeout: float = 30):
        """The value of a JS expression in the page (promises awaited)."""
        r = self.call("Runtime.evaluate", {"expression": expr, "returnByValue": True,
                                           "awaitPromise": True}, timeout)
        if "exceptionDetails" in r:
            raise CdpError(f"{expr!r} threw: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expr: str, timeout: float, what: str,
                 show: str = "document.getElementById('msg')?.textContent"):
        """Polls a JS expression until it is truthy; its value.  On a
        timeout the error quotes the value of `show` (the page's message
        line by default)."""
        deadline = time.monotonic() + timeout
        while True:
            v = self.evaluate(expr)
            if v:
                return v
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what} "
                                     f"({expr}); {show} = {self.evaluate(show)!r}")
            time.sleep(0.1)

    # ---- user actions ---------------------------------------------------

    def navigate(self, url: str, timeout: float = 30) -> None:
        """Loads `url`; events and dialogs seen so far are forgotten."""
        self.events.clear()
        self.dialogs.clear()
        self.call("Page.navigate", {"url": url}, timeout)
        self.wait_for("document.readyState === 'complete'", timeout, f"{url} loaded")

    def click(self, selector: str) -> None:
        """A real mouse click in the middle of the first element matching
        `selector` (scrolled into view first)."""
        box = self.evaluate(
            "(() => { const e = document.querySelector(%s); if (!e) return null;"
            " e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
            " return [r.x + r.width / 2, r.y + r.height / 2]; })()" % json.dumps(selector))
        if not box:
            raise AssertionError(f"nothing matches {selector!r} to click")
        x, y = box
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y,
                                                   "button": "left", "clickCount": 1})

    def type_into(self, selector: str, text: str) -> None:
        """Focuses `selector` and types `text` as keyboard input."""
        self.evaluate("document.querySelector(%s).focus()" % json.dumps(selector))
        self.call("Input.insertText", {"text": text})

    def screenshot(self, path: Path) -> Path:
        """Saves a PNG of the whole page to `path`."""
        r = self.call("Page.captureScreenshot", {"format": "png",
                                                 "captureBeyondViewport": True})
        path.write_bytes(base64.b64decode(r["data"]))
        return path

    def requested_urls(self) -> list[str]:
        return [e["params"]["request"]["url"] for e in self.events
                if e.get("method") == "Network.requestWillBeSent"]

    def close(self) -> None:
        if self.ws is not None:
            try:
                self._send("Browser.close", None)
            except (OSError, websocket.WebSocketException):
                pass
            try:
                self.ws.close()
            except (OSError, websocket.WebSocketException):
                pass
            self.ws = None
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        try:  # the group of the process this object started, by its id
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()
