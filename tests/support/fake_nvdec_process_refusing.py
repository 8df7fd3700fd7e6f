"""As tests/support/fake_nvdec_process.py, with NVDEC failing the first Decode call in the process (a stream it
refuses before its first frame): imported through engine.ingest.procs.TEST_IMPORTS (a test hook only)."""

from engine.testing.fake_nvdec import FakeNvdec
from streams import nvdec

FAKE = FakeNvdec(fail_on_calls=(1,))
nvdec.load_pynvvideocodec = lambda: FAKE
nvdec.cuda_ops = FAKE.cuda
