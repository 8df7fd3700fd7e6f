"""The SAM 2 demo runs end to end on a short clip and writes an annotated mp4 and a PNG."""

import subprocess
import sys

import av

from engine.testing.clips import write_clip
from engine.testing.sam2_ref import make_checkpoint


def test_track_example_writes_annotated_video(tmp_path):
    clip = write_clip(tmp_path / "clip.mp4", 6, size=(160, 120))
    ckpt = make_checkpoint(tmp_path / "ckpt.pt")
    out = tmp_path / "out.mp4"
    run = subprocess.run([sys.executable, "examples/track.py", str(clip), "--box", "20", "15", "80", "75",
                          "--checkpoint", str(ckpt), "--image-size", "256", "--out", str(out), "--png", "3"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("latency_ms") == 6
    with av.open(str(out)) as c:
        assert sum(1 for _ in c.decode(video=0)) == 6
    assert (tmp_path / "out_frame3.png").stat().st_size > 1000
