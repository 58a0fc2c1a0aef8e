"""report.html of a 200-relay log in a real headless Chromium, driven over the DevTools protocol.

The page must load with no console error, exception or network request (everything is
inline), show the summary and the charts before any long table, fit the window's width, and
sort a table when a column header is clicked. Skipped only when Chromium is not installed
(CI installs it: .ci/run).
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession
from websockets.sync.client import ClientConnection, connect

from analytics.run import run_all
from testkit.deadlines import STOP_SECONDS, scaled
from tests.analytics.observation_logs import ObservationLog, network_log

pytestmark = pytest.mark.spark

CHROMIUM = shutil.which("chromium")
WIDTH, HEIGHT = 1280, 1400
DEADLINE_SECONDS = 60.0


class DevTools:
    """A minimal CDP client over one page session (flattened), recording what the page logs."""

    def __init__(self, socket: ClientConnection) -> None:
        self.socket = socket
        self.ids = itertools.count(1)
        self.session: str | None = None
        self.events: list[dict[str, Any]] = []

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        message_id = next(self.ids)
        message: dict[str, Any] = {"id": message_id, "method": method, "params": params}
        if self.session is not None:
            message["sessionId"] = self.session
        self.socket.send(json.dumps(message))
        deadline = time.monotonic() + scaled(DEADLINE_SECONDS)
        while True:
            reply = json.loads(self.socket.recv(timeout=max(0.1, deadline - time.monotonic())))
            if reply.get("id") == message_id:
                assert "error" not in reply, f"{method}: {reply['error']}"
                result: dict[str, Any] = reply["result"]
                return result
            self.events.append(reply)

    def wait_for(self, method: str) -> dict[str, Any]:
        deadline = time.monotonic() + scaled(DEADLINE_SECONDS)
        for seen in self.events:
            if seen.get("method") == method:
                return seen
        while True:
            event: dict[str, Any] = json.loads(
                self.socket.recv(timeout=max(0.1, deadline - time.monotonic()))
            )
            self.events.append(event)
            if event.get("method") == method:
                return event

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[DevTools]:
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    profile = tmp_path / "profile"
    stderr = (tmp_path / "chromium.log").open("w")
    process = subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
         f"--user-data-dir={profile}", f"--window-size={WIDTH},{HEIGHT}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=stderr,
    )
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + scaled(DEADLINE_SECONDS)
        while not (port_file.is_file() and len(port_file.read_text().split()) == 2):
            assert process.poll() is None, (tmp_path / "chromium.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "chromium did not open its DevTools port"
            time.sleep(0.1)
        port, path = port_file.read_text().split()
        with connect(f"ws://127.0.0.1:{port}{path}", max_size=None) as socket:
            tools = DevTools(socket)
            target = tools.call("Target.createTarget", url="about:blank")["targetId"]
            tools.session = tools.call("Target.attachToTarget", targetId=target, flatten=True)[
                "sessionId"
            ]
            yield tools
    finally:
        process.terminate()
        try:
            process.wait(timeout=scaled(STOP_SECONDS))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        stderr.close()


def _problems(events: list[dict[str, Any]]) -> list[str]:
    """Console errors and warnings, uncaught exceptions, logged errors, network requests."""
    found = []
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params["type"] in ("error", "warning", "assert"):
            found.append(f"console.{params['type']}: {params['args']}")
        elif method == "Runtime.exceptionThrown":
            found.append(f"exception: {params['exceptionDetails']}")
        elif method == "Log.entryAdded" and params["entry"]["level"] in ("error", "warning"):
            found.append(f"log: {params['entry']}")
        elif method == "Network.requestWillBeSent":
            url = params["request"]["url"]
            if not url.startswith(("file:", "data:")):
                found.append(f"request: {url}")
    return found


def test_report_of_200_relays_renders_cleanly_in_chromium(
    spark: SparkSession, browser: DevTools, tmp_path: Path
) -> None:
    log = ObservationLog(tmp_path / "observations")
    urls = network_log(log, relays=200)
    out = tmp_path / "report"
    run_all(log.path, str(out))
    page = out / "report.html"

    for domain in ("Page", "Runtime", "Log", "Network"):
        browser.call(f"{domain}.enable")
    browser.call("Page.navigate", url=page.as_uri())
    browser.wait_for("Page.loadEventFired")

    layout = browser.evaluate(
        """(() => {
          const imgs = Array.from(document.images);
          const top = e => e.getBoundingClientRect().top + window.scrollY;
          const long = Array.from(document.querySelectorAll("details:not([open])"));
          return {
            headings: Array.from(document.querySelectorAll("h2")).map(h => h.textContent),
            images: imgs.length,
            broken: imgs.filter(i => !i.complete || i.naturalWidth === 0).length,
            firstImageTop: top(imgs[0]),
            firstLongTableTop: top(long[0]),
            collapsed: long.map(d => d.querySelector("table").tBodies[0].rows.length),
            overflow: document.documentElement.scrollWidth - window.innerWidth,
            worstInbox: document.querySelector(".card td.url").textContent,
          };
        })()"""
    )
    assert _problems(browser.events) == []
    assert layout["headings"] == ["Canary probes", "Missed DMs", "Relay latency", "Delivery funnel"]
    # The four sections' charts and the delivery funnel by notification class.
    assert layout["images"] == 5 and layout["broken"] == 0
    # Charts come before the long tables, which start collapsed: one row per relay each.
    assert layout["firstImageTop"] < layout["firstLongTableTop"] < 2 * HEIGHT
    assert layout["collapsed"][:2] == [200, 200]
    assert layout["overflow"] <= 0, "the page is wider than the window"
    # relay007 loses 60 % of its inbox DMs: the summary names it first.
    assert layout["worstInbox"] == urls[7]

    # Clicking a header sorts that table by it; a second click reverses the order.
    sort = """(() => {
      const table = Array.from(document.querySelectorAll("details table")).find(
        t => t.tHead.textContent.includes("delivery_rate"));
      table.closest("details").open = true;
      const th = Array.from(table.tHead.rows[0].cells).find(c => c.textContent === "delivered");
      th.click();
      const column = () => Array.from(table.tBodies[0].rows, r => Number(r.cells[th.cellIndex].dataset.v));
      const up = column(); th.click(); const down = column();
      return {up, down};
    })()"""
    columns = browser.evaluate(sort)
    assert len(columns["up"]) == 200
    assert columns["up"] == sorted(columns["up"]) and columns["down"] == sorted(columns["up"])[::-1]
    assert columns["up"][0] < columns["up"][-1]
    assert _problems(browser.events) == []

    shot = base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"])
    assert shot.startswith(b"\x89PNG") and len(shot) > 20_000
    (tmp_path / "report.png").write_bytes(shot)
