"""streams/convert.py: a CPU-decoded frame as the ring takes it (RGB through OpenCV or swscale; NV12 unconverted),
and the decoder's thread count for small live frames."""

from __future__ import annotations

import av
import numpy as np
import pytest
import torch

from engine.models.colour import nv12_to_rgb
from streams import convert
from streams.pyav import NetworkSource
from tests.support.colour import nv12_of, tagged_frames

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("matrix, range_", [(None, None), ("bt601", "limited")])
def test_rgb_of_bt601_limited_goes_through_opencv_and_matches_swscale(monkeypatch, matrix, range_):
    frames = tagged_frames(matrix, range_, n=2)
    calls = []
    real = convert.cv2.cvtColor
    monkeypatch.setattr(convert.cv2, "cvtColor", lambda *a, **k: calls.append(1) or real(*a, **k))
    for f in frames:
        ours, ref = convert.to_rgb(f), f.to_ndarray(format="rgb24")
        assert ours.shape == ref.shape and ours.dtype == np.uint8
        d = np.abs(ours.astype(int) - ref.astype(int))
        assert d.max() <= 4 and d.mean() < 1.5, (d.max(), d.mean())  # swscale's own rounding (below)
        # against the exact BT.601 conversion of the same planes, OpenCV is the closer of the two
        nv, colour = convert.to_nv12(f)
        exact = nv12_to_rgb(torch.from_numpy(nv).unsqueeze(0), *colour)[0].permute(1, 2, 0).numpy()
        assert np.abs(ours - exact).mean() < 0.5 < np.abs(ref - exact).mean()
    assert len(calls) == len(frames)  # the fast path was taken


@pytest.mark.parametrize("matrix, range_", [("bt709", "limited"), ("bt601", "full"), ("bt709", "full")])
def test_rgb_of_other_tags_is_swscale_exactly(monkeypatch, matrix, range_):
    monkeypatch.setattr(convert.cv2, "cvtColor", lambda *a, **k: pytest.fail("OpenCV converts BT.601 limited only"))
    for f in tagged_frames(matrix, range_, n=2):
        assert np.array_equal(convert.to_rgb(f), f.to_ndarray(format="rgb24"))


@pytest.mark.parametrize("matrix, range_", [(None, None), ("bt709", "limited"), ("bt601", "full")])
def test_nv12_is_the_decoded_planes_unconverted_with_their_colour(matrix, range_):
    for f in tagged_frames(matrix, range_, n=2, size=(96, 64)) + tagged_frames(matrix, range_, n=1, size=(96, 66)):
        ours, colour = convert.to_nv12(f)
        assert ours.shape == (f.height * 3 // 2, 96) and ours.dtype == np.uint8
        # the planes, byte for byte (66 rows: U and V end mid-row of the packed I420 array; swscale's repack is exact)
        ref = nv12_of(f) if f.height % 4 == 0 else torch.from_numpy(f.reformat(format="nv12").to_ndarray())
        assert torch.equal(torch.from_numpy(ours), ref)
        assert colour == ((matrix or "bt601"), (range_ or "limited"))
        # and the pool's conversion of it is the RGB a decoder would have made (engine/models/colour.py)
        rgb = nv12_to_rgb(torch.from_numpy(ours).unsqueeze(0), *colour)[0].round().clamp(0, 255)
        ref = torch.from_numpy(f.to_ndarray(format="rgb24")).permute(2, 0, 1).float()
        assert (rgb - ref).abs().mean() < 1.5


@pytest.mark.parametrize("size", [(72, 48), (96, 66), (320, 240)])
def test_nv12_planes_write_the_decoded_planes_straight_into_a_slot(size):
    """What an ingest process's slot gets (convert.NV12Planes.write_into): the same bytes as to_nv12's array,
    read through each plane's padded rows (FFmpeg's line_size), every byte of the slot written."""
    for f in tagged_frames(None, None, n=2, size=size):
        planes, _ = convert.nv12_planes(f)
        assert isinstance(planes, convert.NV12Planes) and planes.shape == (f.height * 3 // 2, f.width)
        slot = np.full(planes.shape, 7, np.uint8)
        planes.write_into(slot)
        ref = nv12_of(f) if f.height % 4 == 0 else torch.from_numpy(f.reformat(format="nv12").to_ndarray())
        assert torch.equal(torch.from_numpy(slot), ref)
        assert np.array_equal(np.asarray(planes), slot)
    assert f.planes[0].line_size > f.width or size != (72, 48)  # the padded-rows case is really exercised


def test_nv12_planes_refuse_a_destination_that_does_not_take_them():
    """OpenCV's merge writes a new array when its destination does not take the planes (here its element type):
    write_into must raise, never leave the slot's UV rows unwritten in silence; a wrong width raises too."""
    f = tagged_frames(None, None, n=1, size=(64, 48))[0]
    planes, _ = convert.nv12_planes(f)
    for slot in (np.full((48 * 3 // 2, 64), 7, np.uint16), np.full((48 * 3 // 2, 66), 7, np.uint8)):
        with pytest.raises(ValueError):
            planes.write_into(slot)


def test_nv12_of_odd_sizes_and_other_formats_goes_through_swscale():
    f = tagged_frames(None, None, n=1, size=(64, 48))[0].reformat(format="yuv444p")
    ours, _ = convert.to_nv12(f)
    assert np.array_equal(ours, f.reformat(format="nv12").to_ndarray())
    assert isinstance(convert.nv12_planes(f)[0], np.ndarray)  # not 4:2:0: no planes to hand out
    odd = tagged_frames(None, None, n=1, size=(64, 48))[0].reformat(width=63, height=47)
    ours, _ = convert.to_nv12(odd)
    assert ours.shape == (46 * 3 // 2, 62)
    assert isinstance(convert.nv12_planes(odd)[0], np.ndarray)
    # full range ("yuvj", MJPEG webcams) through swscale comes out limited range, and says so: the pool's NV12 -> RGB
    # maths follows the tag (read as full, black came out 16 and white 235)
    rgb_in = np.zeros((48, 64, 3), np.uint8)
    rgb_in[:, 32:] = 255
    rgb_in[:24, :16] = (200, 30, 60)
    full = av.VideoFrame.from_ndarray(rgb_in, format="rgb24").reformat(format="yuvj422p")
    for f, crop in ((full, rgb_in), (full.reformat(format="yuvj420p").reformat(width=62, height=47), None)):
        ours, colour = convert.to_nv12(f)
        assert colour == ("bt601", "limited"), f.format.name
        back = nv12_to_rgb(torch.from_numpy(ours).unsqueeze(0), *colour)[0].permute(1, 2, 0)
        ref = crop if crop is not None else f.reformat(width=62, height=46, format="rgb24").to_ndarray()
        assert (back - torch.from_numpy(ref).float()).abs().mean() < 3.0, f.format.name


@pytest.mark.parametrize("live, w, h, count", [(True, 320, 240, 1), (True, 640, 480, 0), (True, 1280, 720, 0),
                                               (True, 0, 0, 0), (False, 320, 240, 0)])
def test_a_small_live_frame_decodes_on_one_thread(live, w, h, count):
    src = NetworkSource("cam", "rtsp://127.0.0.1:9/x")
    src.live = live
    assert src._thread_count(w, h) == count
