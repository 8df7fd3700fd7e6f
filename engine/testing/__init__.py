"""Helpers for vidar's tests and benchmarks, like numpy.testing or torch.testing: polling with a deadline
(wait.py), H.264 clips made, decoded and damaged (clips.py), the SAM 2 reference (sam2_ref.py) and a fake
PyNvVideoCodec and of torch.cuda's streams and events (fake_nvdec.py, fake_cuda.py: the GPU tests and gpu_check's dry run on
the CPU).

Why a package in the product rather than in tests/: benchmarks and examples use the same clips and the
same reference as the tests, and they must not import the test suite. The engine itself never imports
engine.testing (tests/test_layout.py checks it); it may import anything of the engine.
"""
