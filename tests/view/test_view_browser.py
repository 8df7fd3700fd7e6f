"""The live view's page in a real browser: headless Chromium driven by Selenium, against `vidar run`.

Skipped when Debian's chromium or chromedriver is missing; failing instead when VIDAR_REQUIRE_BROWSER=1
(`make test`), so a run can never pass by skipping them. Engines run as subprocesses with a tiny model
(test_vit, random weights) on synthetic streams; one classify engine (with a view token) serves the
page tests, and a SAM 2 engine (random weights biased to "object present") only draw to track.
Waits poll with generous deadlines: nothing here asserts on a fixed sleep.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from engine.publish.client import Subscriber
from engine.testing.wait import wait_for
from tests.support.net import free_port

ROOT = Path(__file__).resolve().parents[2]
STATIC = ROOT / "engine" / "view" / "static"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
TOKEN = "hJ4kW9qZ2xN7bV5cM8rT1gY6"
DEADLINE_S = 90  # for anything that needs the engine (start-up, a model warm-up): machines differ 3x
MISSING = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.path.exists(p)]
try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
except ImportError:  # pragma: no cover
    MISSING.append("selenium (pip)")


@pytest.fixture(scope="module", autouse=True)
def _need_browser():  # module scope: it runs before the other module fixtures (an engine, the browser)
    if MISSING:
        why = f"the browser tests need {', '.join(MISSING)} (apt-get install chromium chromium-driver)"
        if os.environ.get("VIDAR_REQUIRE_BROWSER") == "1":
            pytest.fail(f"VIDAR_REQUIRE_BROWSER=1 but {why}", pytrace=False)
        pytest.skip(f"{why}; set VIDAR_REQUIRE_BROWSER=1 to fail instead of skipping")


class Vidar:
    """`vidar run` as a subprocess; the view's URL (and login URL) parsed from its stdout."""

    def __init__(self, tmp: Path, tree: dict, *args: str):
        self.pub = f"tcp://127.0.0.1:{free_port()}"
        tree = {**tree, "publish": {"endpoint": self.pub}, "metrics": {"enabled": False},
                "control": {"endpoint": f"tcp://127.0.0.1:{free_port()}"}, "status": {"interval_s": 30}}
        cfg = tmp / "vidar.yaml"
        cfg.write_text(json.dumps(tree))  # JSON is YAML
        self.log = tmp / "vidar.log"
        vidar = Path(sys.executable).parent / "vidar"  # the venv's entry point, as a user runs it
        self.proc = subprocess.Popen([str(vidar), "run", str(cfg), "--set", "view.port=0", *args], cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=self.log.open("w"), text=True)
        self.url = self.login = None
        started = threading.Event()
        threading.Thread(target=self._read, args=(started,), daemon=True).start()
        if not started.wait(DEADLINE_S) or self.url is None:
            self.stop()
            pytest.fail(f"vidar did not print its view URL; its log:\n{self.log.read_text()[-3000:]}")

    def _read(self, started: threading.Event):
        for line in self.proc.stdout:  # keep reading: a full pipe would block the engine's status lines
            if m := re.search(r"live view on (\S+)", line):
                self.url = m.group(1)
                if m := re.search(r"log in: (\S+?)\)?$", line.strip()):
                    self.login = m.group(1)
                started.set()
        started.set()

    def api(self, method: str = "GET", path: str = "/api/streams", token: str | None = TOKEN) -> dict:
        req = urllib.request.Request(self.url.rstrip("/") + path, method=method,
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return json.load(resp)
        except urllib.error.HTTPError as err:
            return {"status": err.code, **json.load(err)}

    def stop(self):
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def browser():
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1000"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # chromium's temp folders in one of ours: it leaves its org.chromium.Chromium.* (the profile's singleton
    # socket) in TMPDIR after quitting: one more in /tmp per run otherwise. Short: the socket's path must fit 107 bytes
    tmp = tempfile.mkdtemp(prefix="vidar-chromium-")
    try:
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER, env={**os.environ, "TMPDIR": tmp}), options=opts)
        driver.set_script_timeout(60)
        yield driver
        driver.quit()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def classify(tmp_path_factory):
    """Two live synthetic streams through test_vit; the view needs a token (test_token checks it)."""
    synthetic = "synthetic://shapes?size=320x240&fps=15"
    tree = {"streams": [{"id": "a", "url": synthetic, "mode": "live"}, {"id": "b", "url": synthetic, "mode": "live"}],
            "models": {"classify": {"name": "test_vit", "weights": "random", "max_batch": 2, "device": "cpu"}},
            "budget": {"latency_ms": 1000}}
    eng = Vidar(tmp_path_factory.mktemp("classify"), tree, "--set", f"view.token={TOKEN}")
    yield eng
    eng.stop()


def open_page(driver, eng: Vidar, path: str = "/"):
    if eng.login and not driver.get_cookie("vidar_token"):
        driver.get(eng.login)
    driver.get(eng.url.rstrip("/") + path)


def tiles(driver) -> dict:
    return driver.execute_script(
        "const out = {}; for (const t of document.querySelectorAll('.tile')) out[t.dataset.stream] = "
        "{frame: t.dataset.frameSeq, result: t.dataset.resultSeq, state: t.dataset.state}; return out;")


def canvas_pixels(driver, selector: str) -> np.ndarray:
    """The canvas's RGBA pixels (its own resolution)."""
    w, h, data = driver.execute_script(
        "const c = document.querySelector(arguments[0]); const d = c.getContext('2d')"
        ".getImageData(0, 0, c.width, c.height).data; let s = '';"
        "for (let i = 0; i < d.length; i += 32768) s += String.fromCharCode(...d.subarray(i, i + 32768));"
        "return [c.width, c.height, btoa(s)];", selector)
    return np.frombuffer(base64.b64decode(data), np.uint8).reshape(h, w, 4)


def chart_lines(driver, sid: str) -> bool:
    """Both latency lines drawn: pixels near the p50 (#4e9af1) and the p99 (#f5a623) colours."""
    px = canvas_pixels(driver, f"[data-stream='{sid}'] canvas.chart").astype(int)
    def near(rgb):  # lines are anti-aliased: close to the colour, mostly opaque
        return ((np.abs(px[..., :3] - rgb).sum(-1) < 60) & (px[..., 3] > 200)).sum() > 10
    return near((78, 154, 241)) and near((245, 166, 35))


def js_errors(driver) -> list:
    """The page's errors (script errors, failed loads) since the last call."""
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


# -- 5. the RLE decoder against pycocotools (no engine: the module served by a plain HTTP server) --------
def test_rle_decoder_matches_pycocotools(browser):
    from pycocotools import mask as mask_utils
    rng = np.random.default_rng(0)
    blobs = np.zeros((240, 320), np.uint8)
    for cx, cy, r in ((80, 60, 40), (200, 150, 70), (300, 20, 25)):
        yy, xx = np.ogrid[:240, :320]
        blobs |= ((xx - cx) ** 2 + (yy - cy) ** 2 < r * r).astype(np.uint8)
    last = np.zeros((37, 53), np.uint8)
    last[-1, -1] = 1
    masks = {"empty": np.zeros((240, 320), np.uint8), "full": np.ones((240, 320), np.uint8), "blobs": blobs,
             "noise": (rng.random((37, 53)) < 0.5).astype(np.uint8), "last pixel": last,
             "checker": (np.indices((64, 48)).sum(0) % 2).astype(np.uint8),
             "big full": np.ones((600, 800), np.uint8),  # a count of 480000: several 5-bit chunks
             "sparse": (rng.random((480, 640)) < 0.002).astype(np.uint8)}  # long runs, negative deltas
    rles = {k: mask_utils.encode(np.asfortranarray(m)) for k, m in masks.items()}
    sent = {k: {"size": r["size"], "counts": r["counts"].decode()} for k, r in rles.items()}
    handler = functools.partial(type("Quiet", (SimpleHTTPRequestHandler,), {"log_message": lambda *a: None}),
                                directory=str(STATIC))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        browser.get(f"http://127.0.0.1:{server.server_address[1]}/rle.js")  # any page of that origin
        got = browser.execute_async_script(
            "const [rles, done] = arguments; import('/rle.js').then((m) => { const out = {};"
            " for (const [k, r] of Object.entries(rles)) out[k] = m.decodeMask(r).join(''); done(out); },"
            " (e) => done(String(e)));", sent)
    finally:
        server.shutdown()
    assert isinstance(got, dict), got
    for k, m in masks.items():
        expected = mask_utils.decode(rles[k])  # (h, w) row-major, as the page's decoder returns
        assert np.array_equal(expected, m)
        assert got[k] == "".join(map(str, expected.ravel())), f"{k}: the page decodes another mask"


# -- 3. draw to track (SAM 2) ---------------------------------------------------------------------------
def test_draw_to_track_adds_and_removes_objects(browser, tmp_path):
    from engine.testing.sam2_ref import CONFIG, SIZE, make_checkpoint
    ckpt = make_checkpoint(tmp_path / "ck.pt")
    tree = {"streams": [{"id": "cam", "url": "synthetic://shapes?size=320x240&fps=5", "mode": "live"}],
            "models": {"sam2": {"config": CONFIG, "checkpoint": str(ckpt), "image_size": SIZE, "device": "cpu"}},
            "budget": {"latency_ms": 5000}}
    eng = Vidar(tmp_path, tree)
    js_errors(browser)
    try:
        open_page(browser, eng, "/stream/cam")
        assert wait_for(lambda: tiles(browser).get("cam", {}).get("frame"), DEADLINE_S, 0.1), \
            "timed out waiting for a first frame"
        assert wait_for(lambda: browser.find_element(By.ID, "tracking").is_displayed(), DEADLINE_S, 0.1), \
            "timed out waiting for the objects panel"
        browser.execute_script(  # record what the page sends: the prompt must be in the stream's pixels
            "window.sent = []; const f = window.fetch; window.fetch = (url, init) => {"
            " if (init && init.body) window.sent.push(JSON.parse(init.body)); return f(url, init); };")
        canvas = browser.find_element(By.CSS_SELECTOR, "canvas.frame")
        box = [60, 40, 200, 180]  # stream pixels
        scale = canvas.rect["width"] / 320

        def at(x, y):  # offsets from the canvas centre, as ActionChains wants them
            return round(x * scale - canvas.rect["width"] / 2), round(y * scale - canvas.rect["height"] / 2)
        ActionChains(browser).move_to_element_with_offset(canvas, *at(*box[:2])).click_and_hold() \
            .move_to_element_with_offset(canvas, *at(100, 100)).move_to_element_with_offset(canvas, *at(*box[2:])) \
            .release().perform()
        assert wait_for(lambda: eng.api()["streams"]["cam"]["objects"] == [1], DEADLINE_S, 0.1), \
            "timed out waiting for object 1 in GET /api/streams"
        [sent] = browser.execute_script("return window.sent")
        assert sent["id"] == 1 and np.allclose(sent["box"], box, atol=2), sent
        rows = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "li[data-object='1']"), DEADLINE_S, 0.1)
        assert rows, "timed out waiting for object 1's row"
        row = rows[0]
        color = [int(c) for c in row.get_attribute("data-color").split(",")]

        def mask_in_box():  # the mask's opaque outline, in object 1's colour, inside the drawn box
            t = tiles(browser)["cam"]
            px = canvas_pixels(browser, "canvas.frame")[box[1]:box[3], box[0]:box[2], :3]
            return t["frame"] == t["result"] and int((px == color).all(-1).sum())
        assert wait_for(mask_in_box, DEADLINE_S, 0.1) >= 20, \
            "timed out waiting for object 1's mask drawn inside the box"
        browser.find_element(By.CSS_SELECTOR, "li[data-object='1'] .remove-object").click()
        assert wait_for(lambda: eng.api()["streams"]["cam"]["objects"] == [], DEADLINE_S, 0.1), \
            "timed out waiting for object 1 gone from the API"
        assert wait_for(lambda: not browser.find_elements(By.CSS_SELECTOR, "li[data-object='1']"), DEADLINE_S, 0.1), \
            "timed out waiting for object 1's row gone"
        # points: one on the object, one shift-clicked as background, then Track: the next free id
        ActionChains(browser).move_to_element_with_offset(canvas, *at(160, 120)).click() \
            .move_to_element_with_offset(canvas, *at(20, 20)).key_down(Keys.SHIFT).click().key_up(Keys.SHIFT).perform()
        count = browser.find_element(By.CSS_SELECTOR, "#points .count").text
        assert count.startswith("1 object point(s), 1 background"), count
        browser.find_element(By.CSS_SELECTOR, "#points .send").click()
        assert wait_for(lambda: eng.api()["streams"]["cam"]["objects"] == [2], DEADLINE_S, 0.1), \
            "timed out waiting for object 2 (points) in the API"
        sent = browser.execute_script("return window.sent")[-1]
        assert sent["id"] == 2 and np.allclose(sent["points"], [[160, 120, 1], [20, 20, 0]], atol=2), sent
        assert js_errors(browser) == []
    finally:
        # away from the page first: left open on a stopped engine, its WebSocket retries (live.js reconnects), and
        # on a loaded machine a refused retry landed in the next test's browser log
        browser.get("about:blank")
        eng.stop()


# -- 1, 2, 4, 6: the classify engine --------------------------------------------------------------------
def test_all_streams_page_shows_frames_results_and_stats(browser, classify):
    sub = Subscriber(classify.pub, ["classify.a"])  # what the engine published: the label for each seq
    published = {}
    js_errors(browser)
    open_page(browser, classify)
    assert wait_for(lambda: set(tiles(browser)) == {"a", "b"} and all(t["frame"] for t in tiles(browser).values()),
                    DEADLINE_S, 0.1), "timed out waiting for two tiles with frames"
    pixels = canvas_pixels(browser, "[data-stream='a'] canvas.frame")
    assert pixels.shape == (240, 320, 4) and pixels[..., :3].std() > 10, "the frame canvas is blank"

    def caption_matches():  # the page's top-1 for the frame on show is what was published for that seq
        while (m := sub.recv(0)) is not None:
            published[m["seq"]] = m["topk"][0][1].split(",")[0]
        seq, text = browser.execute_script(
            "const t = document.querySelector(\"[data-stream='a']\");"
            "return [t.dataset.resultSeq, t.querySelector('.caption .top1')?.textContent];")
        return int(seq) in published and (text, published[int(seq)])
    caption = wait_for(caption_matches, DEADLINE_S, 0.1)
    assert caption, "timed out waiting for a caption for a seq whose result was published"
    text, label = caption
    sub.close()
    assert text.startswith(label + " ") and text.endswith("%")
    assert browser.find_element(By.CSS_SELECTOR, "[data-stream='a'] .caption").is_displayed()  # top1: new per frame
    for sid in ("a", "b"):
        tile = browser.find_element(By.CSS_SELECTOR, f"[data-stream='{sid}']")
        # the state comes once a second: in an ingest process a stream's first frames can reach the page before
        # the state message that says it runs (a thread said so before its first frame)
        assert wait_for(lambda: tile.get_attribute("data-state") == "running", DEADLINE_S, 0.1), \
            tile.get_attribute("data-state")
        assert tile.find_element(By.CSS_SELECTOR, ".state").text == "running"
        rates = wait_for(lambda: re.search(r"in (\d+\.\d) fps · out (\d+\.\d) fps",
                                           tile.find_element(By.CSS_SELECTOR, ".pool .rates").text), DEADLINE_S, 0.1)
        assert rates, "timed out waiting for fps"
        assert float(rates[1]) > 0 and float(rates[2]) > 0
        assert tile.find_element(By.CSS_SELECTOR, ".pool .drops").text.startswith("dropped: ")
        assert "budget 1000 ms" in tile.find_element(By.CSS_SELECTOR, ".pool .legend").text
        assert wait_for(lambda: chart_lines(browser, sid), DEADLINE_S, 0.1), \
            "timed out waiting for the p50 and p99 lines on the latency chart"
    assert js_errors(browser) == []


def test_overlays_are_drawn_on_their_own_frame(browser, classify):
    """Every draw, seen by a MutationObserver in the page (not sampled): the results drawn on a frame
    are that frame's. A frame may come without results once (a tile reopened: the server then sends
    the last frame it showed without its results; see the report), never after one with results."""
    open_page(browser, classify)
    browser.execute_script(
        "window.seen = []; new MutationObserver((records) => { for (const r of records) {"
        " const d = r.target.dataset; window.seen.push([d.stream, d.frameSeq, d.resultSeq]); } })"
        ".observe(document.getElementById('tiles'),"
        " {subtree: true, attributeFilter: ['data-frame-seq', 'data-result-seq']});")
    assert wait_for(lambda: browser.execute_script("return new Set(window.seen.map((s) => s[0] + s[1])).size") >= 40,
                    DEADLINE_S, 0.1), "timed out waiting for 40 frame updates"
    seen = browser.execute_script("return window.seen")
    for sid in ("a", "b"):
        draws = [(f, r) for s, f, r in seen if s == sid]
        while draws and draws[0][1] == "":
            draws.pop(0)
        assert len(draws) >= 10 and all(f == r for f, r in draws), draws


def test_tiles_get_frames_no_larger_than_they_show(browser, classify):
    """Each tile asks for the size it shows its stream at (rounded up to 64 device pixels): narrowed to
    150 CSS px, the tiles get frames of at most that step instead of the streams' 320x240; widened
    again, full-size frames again."""
    open_page(browser, classify)
    assert wait_for(lambda: {"a", "b"} <= set(tiles(browser)) and all(t["frame"] for t in tiles(browser).values()),
                    DEADLINE_S, 0.1), "timed out waiting for two tiles with frames"

    def shown():  # per tile: the longer side of the frame it drew last, and its shown size's step
        got = browser.execute_script(
            "const out = {}; for (const c of document.querySelectorAll('.tile canvas.frame')) {"
            " const r = c.getBoundingClientRect(); out[c.closest('.tile').dataset.stream] ="
            " [c.dataset.frameSize || '', Math.max(r.width, r.height) * devicePixelRatio]; } return out;")
        return {sid: (max(map(int, size.split("x"))) if size else 0, -(-px // 64) * 64)
                for sid, (size, px) in got.items()}
    assert wait_for(lambda: all(side == 320 for side, _ in shown().values()), DEADLINE_S, 0.1), \
        "timed out waiting for full-size frames in wide tiles"
    browser.execute_script("document.getElementById('tiles').style.gridTemplateColumns = 'repeat(auto-fill, 150px)'")
    small = wait_for(lambda: (s := shown()) and all(0 < side <= step for side, step in s.values()) and s,
                     DEADLINE_S, 0.1)
    assert small, "timed out waiting for frames no larger than the narrowed tiles show"
    assert all(step < 320 for _, step in small.values()), small  # the check above could not pass unchanged
    browser.execute_script("document.getElementById('tiles').style.gridTemplateColumns = ''")
    assert wait_for(lambda: all(side == 320 for side, _ in shown().values()), DEADLINE_S, 0.1), \
        "timed out waiting for full-size frames once widened again"


def test_add_and_remove_a_stream_from_the_page(browser, classify):
    open_page(browser, classify)
    assert wait_for(lambda: {"a", "b"} <= set(tiles(browser)), DEADLINE_S, 0.1), "timed out waiting for the tiles"
    form = browser.find_element(By.ID, "add-stream")
    form.find_element(By.NAME, "id").send_keys("added")
    form.find_element(By.NAME, "url").send_keys("synthetic://shapes?size=160x120&fps=10")
    form.find_element(By.CSS_SELECTOR, "button").click()
    assert wait_for(lambda: tiles(browser).get("added", {}).get("frame"), DEADLINE_S, 0.1), \
        "timed out waiting for the added stream's tile with a frame"
    assert form.find_element(By.NAME, "id").get_attribute("value") == ""  # the form is cleared on success
    form.find_element(By.NAME, "id").send_keys("added")  # again: the API's error is shown
    form.find_element(By.NAME, "url").send_keys("synthetic://shapes?size=160x120&fps=10")
    form.find_element(By.CSS_SELECTOR, "button").click()
    error = browser.find_element(By.ID, "error")
    assert wait_for(lambda: error.is_displayed() and "already running" in error.text, DEADLINE_S, 0.1), \
        "timed out waiting for the API's error on the page"
    browser.find_element(By.CSS_SELECTOR, "[data-stream='added'] .remove-stream").click()
    assert wait_for(lambda: "added" not in tiles(browser), DEADLINE_S, 0.1), \
        "timed out waiting for the removed stream's tile gone"
    assert "added" not in classify.api()["streams"] and {"a", "b"} <= set(tiles(browser))


def test_token_is_needed_and_the_login_url_works(browser, classify):
    browser.delete_all_cookies()
    browser.get(classify.url)
    assert "needs its token" in browser.find_element(By.TAG_NAME, "body").text and not tiles(browser)
    assert classify.api(token=None)["status"] == 401
    browser.get(classify.url.rstrip("/") + "/login?token=wrong-token-0123456789")
    assert "wrong or missing token" in browser.find_element(By.TAG_NAME, "body").text
    assert classify.login and TOKEN in classify.login
    browser.get(classify.login)
    assert browser.current_url == classify.url  # redirected to the page
    assert wait_for(lambda: {"a", "b"} <= set(tiles(browser)) and tiles(browser)["a"]["frame"], DEADLINE_S, 0.1), \
        "timed out waiting for the page working"
