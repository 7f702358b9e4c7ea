"""A page in a real headless browser (Debian's `chromium`), driven over the DevTools protocol:
what it logged to the console, the exceptions it threw, the requests it made, a JavaScript
expression evaluated in it, and a screenshot.

    python -m tests.integration.browser PAGE.html OUT.png [HEIGHT]   # a screenshot (the README's)
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class Visit:
    console_errors: list[str] = field(default_factory=list)  # console.error, uncaught exceptions, error log entries
    requests: list[str] = field(default_factory=list)  # every URL the page asked for
    value: Any = None  # what the expression returned
    screenshot: bytes = b""


class DevTools:
    def __init__(self, ws) -> None:
        self.ws, self.next_id, self.events = ws, 0, []

    async def call(self, method: str, **params: Any) -> dict:
        self.next_id += 1
        await self.ws.send_json({"id": self.next_id, "method": method, "params": params})
        while True:
            message = await asyncio.wait_for(self.ws.receive_json(), 60)
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    async def until(self, event: str) -> None:
        while not any(e.get("method") == event for e in self.events):
            self.events.append(await asyncio.wait_for(self.ws.receive_json(), 60))


def _errors(events: list[dict]) -> list[str]:
    found = []
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            found.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", [])))
        elif method == "Runtime.exceptionThrown":
            found.append(params["exceptionDetails"].get("text", "exception"))
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            found.append(params["entry"].get("text", ""))
    return found


async def _visit(page: pathlib.Path, expression: str, width: int, height: int | None) -> Visit:
    import aiohttp

    # chromium's helper processes may still write into the profile for a moment after it is killed
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        browser = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
             f"--user-data-dir={profile}", "--remote-debugging-port=0", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            url = None
            while url is None:  # "DevTools listening on ws://127.0.0.1:PORT/devtools/browser/ID"
                line = await asyncio.wait_for(asyncio.to_thread(browser.stderr.readline), 60)
                if not line:
                    raise RuntimeError("chromium exited before its DevTools endpoint was up")
                match = re.search(r"DevTools listening on (ws://\S+)", line)
                url = match and match.group(1)
            port = re.search(r":(\d+)/", url).group(1)
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://127.0.0.1:{port}/json/list") as reply:
                    target = next(t for t in await reply.json() if t["type"] == "page")
                async with session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                    return await _drive(DevTools(ws), page, expression, width, height)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(browser.pid, signal.SIGKILL)  # chromium and every helper it started
            browser.wait(timeout=30)


async def _drive(tools: DevTools, page: pathlib.Path, expression: str, width: int, height: int | None) -> Visit:
    for domain in ("Runtime", "Log", "Page", "Network"):
        await tools.call(f"{domain}.enable")
    await tools.call("Emulation.setDeviceMetricsOverride", width=width, height=height or 1200, deviceScaleFactor=1,
                     mobile=False)
    await tools.call("Page.navigate", url=page.resolve().as_uri())
    await tools.until("Page.loadEventFired")
    result = await tools.call("Runtime.evaluate", expression=expression, returnByValue=True)
    if "exceptionDetails" in result:
        raise RuntimeError(f"the expression threw: {result['exceptionDetails']}")
    full = (await tools.call("Runtime.evaluate", expression="document.documentElement.scrollHeight",
                             returnByValue=True))["result"]["value"]
    await tools.call("Emulation.setDeviceMetricsOverride", width=width, height=height or full, deviceScaleFactor=1,
                     mobile=False)
    shot = await tools.call("Page.captureScreenshot", format="png")
    return Visit(_errors(tools.events), [e["params"]["request"]["url"] for e in tools.events
                                         if e.get("method") == "Network.requestWillBeSent"],
                 result["result"].get("value"), base64.b64decode(shot["data"]))


def visit(page: pathlib.Path, expression: str = "null", width: int = 1000, height: int | None = None) -> Visit:
    """Load `page` in headless Chromium, evaluate `expression` once it loaded, take a screenshot
    (`height` None: the whole page)."""
    if CHROMIUM is None:
        raise RuntimeError("chromium is not installed (apt-get install chromium)")
    return asyncio.run(_visit(page, expression, width, height))


if __name__ == "__main__":
    out = pathlib.Path(sys.argv[2])
    out.write_bytes(visit(pathlib.Path(sys.argv[1]), height=int(sys.argv[3]) if len(sys.argv) > 3 else None)
                    .screenshot)
    print(json.dumps({"screenshot": str(out), "bytes": out.stat().st_size}))
