"""Roboflow inference's InferencePipeline with N RTSP URLs, no model and a counting sink (the peers' venv).

    .venv-peers/bin/python benchmarks/peers/peer_inference.py URLS_FILE default|tuned

  default  `InferencePipeline.init_with_custom_logic(video_reference=URLS, on_video_frame=..., on_prediction=...,
           max_fps=None)`, every other argument at its default (legacy collection: a round waits for a frame
           of each source; EAGER consumption, ADAPTIVE_DROP_OLDEST filling).
  tuned    the same with `video_processing_mode="auto"` and, in the environment before the import,
           VIDEO_SOURCE_ADAPTIVE_BACKPRESSURE=True: the package's own advice for several live sources (its
           docstrings: legacy collection "collapses" with staggered cameras; the open-loop ADAPTIVE rules can
           pin throughput). Its maximum throughput, which is what the peer would be run at.
on_video_frame returns an empty dict per frame (the peers' no-op model); the sink counts distinct
(source_id, frame_id) and takes, per frame, now - `frame_timestamp` (taken before `grab()` on a live stream,
so it includes the wait for the frame when the reader keeps up). `frame_id` counts every frame the source's
reader grabbed, so its advance is the intake. Dropped-frame status updates are counted by cause.
Protocol: benchmarks/peers/sink.py.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from datetime import datetime

from sink import Tally, emit, serve_commands


def main() -> None:
    urls_file, variant = sys.argv[1], sys.argv[2]
    urls = [u.strip() for u in open(urls_file) if u.strip()]
    if variant == "tuned":  # read by inference at import
        os.environ["VIDEO_SOURCE_ADAPTIVE_BACKPRESSURE"] = "True"
    from inference import InferencePipeline

    tally, drops, lock = Tally(list(range(len(urls)))), Counter(), threading.Lock()

    def on_video_frame(frames: list) -> list[dict]:
        return [{} for _ in frames]

    def on_prediction(_predictions: object, frames: object) -> None:
        now = datetime.now()
        for f in frames if isinstance(frames, list) else [frames]:
            if f is not None:
                tally.add(f.source_id, f.frame_id, (now - f.frame_timestamp).total_seconds() * 1e3)

    def on_status(update: object) -> None:
        if getattr(update, "event_type", None) == "FRAME_DROPPED":
            with lock:
                drops[str(update.payload.get("cause"))] += 1
                tally.extra["dropped_updates"] = dict(drops)

    kwargs: dict = dict(video_reference=urls, on_video_frame=on_video_frame, on_prediction=on_prediction,
                        max_fps=None, status_update_handlers=[on_status])
    if variant == "tuned":
        kwargs["video_processing_mode"] = "auto"
    t0 = time.time()
    pipeline = InferencePipeline.init_with_custom_logic(**kwargs)
    pipeline.start(use_main_thread=False)
    emit({"event": "started", "t": time.time(), "init_s": time.time() - t0, "variant": variant})
    stop = threading.Event()
    serve_commands(tally, stop.set)
    stop.wait()
    t1 = time.time()
    pipeline.terminate()
    pipeline.join()
    emit({"event": "stopped", "stop_s": time.time() - t1})


if __name__ == "__main__":
    main()
