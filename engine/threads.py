"""Intra-op thread counts per calling thread.

torch.set_num_threads reaches OpenMP's `omp_set_num_threads`, whose setting belongs to the calling
thread: each worker thread (and SAM 2's output thread) sets its own, and warm-up, run on the
engine's starting thread, borrows the workers' count for its measurement and gives it back.

One trap: torch's first parallel op on a thread (or get_num_threads) re-applies the count last set
by ANY thread, so a plain set_num_threads is undone by a later one on another thread (measured: a
thread that set 1, then another set 2, ran its next op with 2). Initialising first makes it stick.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional


def set_intra_op_threads(n: Optional[int]) -> None:
    """The calling thread's intra-op thread count (None: leave it as it is)."""
    if n:
        import torch
        torch.get_num_threads()  # this thread's lazy initialisation first (see above)
        torch.set_num_threads(n)


@contextlib.contextmanager
def intra_op_threads(n: Optional[int]) -> Iterator[None]:
    """Run a block with n intra-op threads on this thread, then restore the count it had."""
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
