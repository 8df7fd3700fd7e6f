"""Ultralytics' multi-stream loader with N RTSP URLs and a consumer that only counts (the peers' venv).

    .venv-peers/bin/python benchmarks/peers/peer_ultralytics.py URLS_FILE

The loader is built as `model.predict(source="list.streams", stream=True)` builds it, with the predictor's
defaults (`vid_stride=1`, `stream_buffer=False`): `load_inference_source(path, batch=1, vid_stride=1,
buffer=False)`, i.e. LoadStreams. The model is left out (the other systems run none either). Each iteration
yields one image per stream, the latest its reader thread decoded; a frame is told apart from the previous one
of its stream by a CRC of a strided sample (the clips carry temporal noise and a moving counter, so two
decoded frames never share it). No timestamp travels with a frame: latency is not measurable.
Protocol: benchmarks/peers/sink.py.
"""

from __future__ import annotations

import sys
import threading
import time
import zlib

from sink import Tally, emit, serve_commands


def main() -> None:
    urls_file = sys.argv[1]
    from ultralytics.data.build import load_inference_source

    t0 = time.time()
    loader = load_inference_source(urls_file, batch=1, vid_stride=1, buffer=False)  # opens every stream, in turn
    n = len(loader)
    emit({"event": "started", "t": time.time(), "open_s": time.time() - t0, "streams": n,
          "loader": type(loader).__name__})
    tally, last_crc = Tally(list(range(n))), [None] * n
    stop = threading.Event()
    serve_commands(tally, stop.set)
    for _paths, images, _info in loader:
        for i, im in enumerate(images):
            crc = zlib.crc32(im[::8, ::8].tobytes())
            if crc == last_crc[i]:  # the same image handed again (its reader had nothing newer)
                tally.extra["repeated"] = tally.extra.get("repeated", 0) + 1
                continue
            last_crc[i] = crc
            tally.add(i, None)
        if stop.is_set():
            break
    t1 = time.time()
    loader.close()
    emit({"event": "stopped", "stop_s": time.time() - t1})


if __name__ == "__main__":
    main()
