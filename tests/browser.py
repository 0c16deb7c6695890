"""Headless Chromium driven over the DevTools protocol (websocket-client).

Shared by the runtime tests (tests/docker/test_runtime.py) and the README
pictures (scripts/pictures.py). Needs Debian's `chromium` on the host.
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import requests
import websocket

from tests.support import stop_process, wait_until

LOCAL = "127.0.0.1"


class BrowserMissing(RuntimeError):
    """No Chromium on this host."""


def _chromium_tmp() -> set[Path]:
    """Chromium's own folders in the temporary folder (it makes one per run)."""
    return set(Path(tempfile.gettempdir()).glob("org.chromium.Chromium.*"))


class Chrome:
    """One headless Chromium with its own profile; `call` sends a DevTools command."""

    def __init__(self, profile: Path, width: int = 1400, height: int = 900):
        exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
        if not exe:
            raise BrowserMissing("no chromium on this host. Fix: apt-get install -y chromium")
        self._tmp_before = _chromium_tmp()
        self.proc = subprocess.Popen(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--no-first-run", "--no-default-browser-check", "--disable-dev-shm-usage",
             "--remote-debugging-port=0", f"--user-data-dir={profile}", f"--window-size={width},{height}",
             "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            active = profile / "DevToolsActivePort"
            port = wait_until(lambda: active.exists() and active.read_text().split()[0], 60,
                              what="Chromium's DevTools port")
            pages = wait_until(lambda: [t for t in requests.get(f"http://{LOCAL}:{port}/json", timeout=5).json()
                                        if t["type"] == "page"], 30, what="a Chromium page target")
            self.ws = websocket.create_connection(pages[0]["webSocketDebuggerUrl"], timeout=60,
                                                  suppress_origin=True)
        except BaseException:
            self._stop()
            raise
        self.ids = itertools.count(1)
        # The viewport is exactly width x height, whatever the window decorations take.
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                  mobile=False)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        mid = next(self.ids)
        self.ws.send(json.dumps({"id": mid, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == mid:
                if "error" in msg:
                    raise AssertionError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def js(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")

    def screenshot(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))
        return path

    def _stop(self) -> None:
        stop_process(self.proc, grace=10)
        # What this browser left in the temporary folder (org.chromium.Chromium.*): removed once it has stopped.
        for left in _chromium_tmp() - self._tmp_before:
            shutil.rmtree(left, ignore_errors=True)

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            self._stop()
