"""benchmarks/bench_peers.py's parts: the clips, the RTSP server, the sinks of vidar and of the peers (each run in
its own interpreter, sharing only sink.py), and the pure accounting (measure.py)."""
