"""A headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`: JSON
messages ended by NUL on the browser's fds 3 and 4), so a test needs no driver nor websocket
library: open a page in a tab of its own, see every request that page makes
(`Network.requestWillBeSent` of its session: the browser's own background traffic is not the
page's), evaluate JavaScript in it.

    with Browser(chromium, profile, proxy_url) as b:
        tab = b.open(url)              # navigated, load event fired
        tab.wait_for(js_condition)     # polled until truthy
        tab.evaluate(js) / tab.requests
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-default-apps", "--disable-extensions",
]  # fmt: skip


class Browser:
    def __init__(self, chromium: str, profile: Path, proxy_url: str | None = None) -> None:
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        flags = [*FLAGS, f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"]
        if proxy_url:
            flags.append(f"--proxy-server={proxy_url}")
        # The browser wants the pipe on fds 3 (it reads) and 4 (it writes): bash puts them there
        # (dash takes single-digit fds only).
        script = f'exec "$0" "$@" 3<&{to_browser_r} 4>&{from_browser_w}'
        self.proc = subprocess.Popen(
            ["bash", "-c", script, chromium, *flags], pass_fds=(to_browser_r, from_browser_w),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._next_id = 0
        self._replies: dict[int, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        buffer = b""
        while chunk := os.read(self._from_browser, 1 << 16):
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            with self._changed:
                for raw in messages:
                    message = json.loads(raw)
                    if "id" in message:
                        self._replies[message["id"]] = message
                    else:
                        self.events.append(message)
                self._changed.notify_all()

    def call(self, method: str, session: str | None = None, timeout: float = 30, **params: Any) -> Any:
        self._next_id += 1
        ident = self._next_id
        message: dict[str, Any] = {"id": ident, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        with self._changed:
            if not self._changed.wait_for(lambda: ident in self._replies, timeout):
                raise TimeoutError(f"no answer to {method}")
            reply = self._replies.pop(ident)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    def open(self, url: str, timeout: float = 60) -> Tab:
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        tab = Tab(self, session)
        self.call("Network.enable", session)
        self.call("Page.enable", session)
        self.call("Page.navigate", session, url=url)
        tab.wait_event("Page.loadEventFired", timeout)
        return tab

    def close(self) -> None:
        with contextlib.suppress(OSError, TimeoutError, RuntimeError):
            self.call("Browser.close", timeout=10)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        os.close(self._to_browser)
        self._reader.join(5)
        os.close(self._from_browser)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Tab:
    def __init__(self, browser: Browser, session: str) -> None:
        self.browser = browser
        self.session = session

    def session_events(self, method: str) -> list[dict[str, Any]]:
        with self.browser._changed:
            return [e["params"] for e in self.browser.events
                    if e.get("sessionId") == self.session and e["method"] == method]  # fmt: skip

    @property
    def requests(self) -> list[str]:
        """Every URL this page requested (documents, scripts, styles, fetches, images), in order."""
        return [e["request"]["url"] for e in self.session_events("Network.requestWillBeSent")]

    def wait_event(self, method: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.session_events(method):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {method}")
            time.sleep(0.05)

    def evaluate(self, expression: str) -> Any:
        answer = self.browser.call("Runtime.evaluate", self.session, expression=expression,
                                   returnByValue=True)  # fmt: skip
        return answer["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30) -> Any:
        """Poll `expression` until it is truthy; its value (falsy after `timeout`)."""
        deadline = time.monotonic() + timeout
        while not (value := self.evaluate(expression)) and time.monotonic() < deadline:
            time.sleep(0.1)
        return value
