"""docs/img/live-view.png: the live view of the demo, as Chromium shows it (made, not drawn).

    python scripts/screenshot_view.py [--config configs/demo.yaml] [--out docs/img/live-view.png]

Starts `vidar run` on the demo config in a subprocess (without a GPU it applies the config's `on_cpu`
overrides, as `make run` does), on free ports so it never collides with a running engine; reads the view's
URL from the line `vidar run` prints; opens it in Debian's chromium through selenium, headless (as
tests/view/test_view_browser.py does); waits until every tile shows a frame with its results and the
latency chart has had `--settle` seconds to fill; saves the page; stops vidar with SIGINT (its drain),
then SIGKILL if it does not exit. `make screenshot` runs it (apt packages: scripts/install-browser-deps.sh).
Not part of `make test`: it takes about a minute.
"""

from __future__ import annotations

import argparse
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.testing.net import free_port  # noqa: E402

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
VIEW_LINE = re.compile(r"vidar: live view on (\S+)")


class ScreenshotError(Exception):
    """The demo or the browser did not get to a page worth showing; the message says which step."""


def start_vidar(config: Path) -> tuple[subprocess.Popen, "queue.Queue[str]"]:
    """`vidar run CONFIG` on free ports; its output lines go to a queue (read by a thread, so a full pipe
    never blocks vidar) and are echoed to stderr for whoever watches."""
    sets = [f"view.port={free_port()}", f"publish.endpoint=tcp://127.0.0.1:{free_port()}",
            f"metrics.port={free_port()}", f"control.endpoint=tcp://127.0.0.1:{free_port()}"]
    cmd = [sys.executable, "-m", "engine.cli", "run", str(config)] + [a for s in sets for a in ("--set", s)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: "queue.Queue[str]" = queue.Queue()

    def pump():
        for line in proc.stdout:
            sys.stderr.write(f"  | {line}")
            lines.put(line)
    threading.Thread(target=pump, name="vidar-output", daemon=True).start()
    return proc, lines


def view_url(proc: subprocess.Popen, lines: "queue.Queue[str]", timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ScreenshotError(f"vidar run exited with {proc.returncode} before serving the view (output above)")
        try:
            m = VIEW_LINE.search(lines.get(timeout=0.5))
        except queue.Empty:
            continue
        if m:
            return m.group(1)
    raise ScreenshotError(f"vidar run printed no 'live view on' line within {timeout_s:g} s")


def stop_vidar(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # the drain `make run` gets on Ctrl-C
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def shoot(url: str, out: Path, *, width: int, height: int, wait_s: float, settle_s: float) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--hide-scrollbars"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        driver.get(url)
        deadline = time.monotonic() + wait_s
        ready_at = None
        while time.monotonic() < deadline:
            # every tile has drawn a frame and the results of a frame (the page matches them by seq)
            ready = driver.execute_script(
                "const t = [...document.querySelectorAll('.tile')];"
                "return t.length > 0 && t.every(x => x.dataset.frameSeq && x.dataset.resultSeq);")
            if ready and ready_at is None:
                ready_at = time.monotonic()
                print(f"screenshot_view: tiles show frames with results; letting the chart fill for {settle_s:g} s",
                      file=sys.stderr)
            if ready_at is not None and time.monotonic() - ready_at >= settle_s:
                out.parent.mkdir(parents=True, exist_ok=True)
                if not driver.save_screenshot(str(out)):
                    raise ScreenshotError(f"chromium could not write {out}")
                return
            time.sleep(0.5)
        raise ScreenshotError(f"no tile showed a frame with its results within {wait_s:g} s of opening {url}")
    finally:
        driver.quit()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Screenshot of the demo's live view in Chromium")
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "demo.yaml")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "live-view.png")
    ap.add_argument("--width", type=int, default=1200)
    ap.add_argument("--height", type=int, default=760)
    ap.add_argument("--start-timeout", type=float, default=300, help="seconds for vidar to load and warm up")
    ap.add_argument("--wait", type=float, default=120, help="seconds for the first frame with results")
    ap.add_argument("--settle", type=float, default=20, help="seconds of chart after the first results")
    args = ap.parse_args(argv)
    for path in (CHROMIUM, CHROMEDRIVER):
        if not Path(path).exists():
            print(f"screenshot_view: {path} is missing: run scripts/install-browser-deps.sh "
                  "(apt-get install chromium chromium-driver)", file=sys.stderr)
            return 2
    proc, lines = start_vidar(args.config)
    try:
        url = view_url(proc, lines, args.start_timeout)
        shoot(url, args.out, width=args.width, height=args.height, wait_s=args.wait, settle_s=args.settle)
    except ScreenshotError as err:
        print(f"screenshot_view: {err}", file=sys.stderr)
        return 1
    finally:
        stop_vidar(proc)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
