"""The fake PyNvVideoCodec and fake CUDA (engine/testing/fake_nvdec.py) installed in an ingest process: imported there
through engine.ingest.procs.TEST_IMPORTS (a test hook; the product never sets it), so a stream the engine sent with
decode auto/cuda decodes "on the GPU" in the process as streams/nvdec.py would, on a machine without one."""

from engine.testing.fake_nvdec import FakeNvdec
from streams import nvdec

FAKE = FakeNvdec()
nvdec.load_pynvvideocodec = lambda: FAKE
nvdec.cuda_ops = FAKE.cuda
