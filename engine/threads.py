"""Intra-op thread counts per calling thread.

torch.set_num_threads reaches OpenMP's `omp_set_num_threads`, whose setting belongs to the calling
thread: each worker thread (and SAM 2's output thread) sets its own, and warm-up, run on the
engine's starting thread, borrows the workers' count for its measurement and gives it back.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional


def set_intra_op_threads(n: Optional[int]) -> None:
    if n:
        import torch
        torch.set_num_threads(n)


@contextlib.contextmanager
def intra_op_threads(n: Optional[int]) -> Iterator[None]:
    if not n:
        yield
        return
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
