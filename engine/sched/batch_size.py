"""`max_batch: auto`: the largest batch a pool forms, chosen at start from its measured batch times.

Pure: it reads a latency estimate and a budget, no model and no clock, so the table tests need neither.

The rule. A live frame that arrives just after its worker started a batch waits for that batch, then runs
in its own: about twice a batch's run time from ready to done. So the largest batch size b whose estimate
(the latency model's high quantile: mean + k deviations, what the scheduler plans with) fits twice in
`budget.latency_ms` is the most throughput the budget allows: a larger batch buys frames/s the deadline
then drops. Measured on an H200 with ViT-L/16 graphs (../shared/gpu/README.md): batch 1 1.39 ms, batch 8
2.74 ms; at 17 ms the rule keeps the sizes whose estimate is at most 8.5 ms. The times are the model's
forward alone, timed at start on random input: preprocessing and the results' copy add to a batch's real
time, and the scheduler's latency model learns those from the batches it runs.

The sweep stops at the first size that does not fit (`stop_sweep`): a larger one would not be chosen, and
on a CPU measuring it costs seconds (ViT-L/16 batch 64 is ~30 s on two cores).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

#: runs per size in the sweep, the median kept: a stall on a shared machine (another process, a first call's
#: one-time cost) only lengthens a run, and one such run (b1 1,384 ms against 42 ms, seen on our CPU machine
#: while another process ran) would otherwise set max_batch to 1
SWEEP_REPEATS = 3


def candidate_sizes(ceiling: int) -> list[int]:
    """1, 2, 4, 8, ... up to `ceiling`, and `ceiling`: the sizes an auto sweep measures, and the CUDA graph
    sizes captured by default (graphs.default_sizes). Powers of two keep the padding to the next captured
    size under 2x with log2(ceiling) sizes; vLLM pads the same way."""
    if ceiling < 1:
        raise ValueError(f"max_batch must be >= 1, got {ceiling}")
    sizes, b = [], 1
    while b < ceiling:
        sizes.append(b)
        b *= 2
    return sizes + [ceiling]


def fits(estimate_s: float, budget_s: float) -> bool:
    """A batch of this run time leaves a frame that waited for the batch before it within the budget."""
    return 2 * estimate_s <= budget_s


def stop_sweep(estimate_s: float, budget_s: float) -> bool:
    """Measure no larger size: this one does not fit already (run times grow with the batch)."""
    return not fits(estimate_s, budget_s)


@dataclass(frozen=True)
class BatchChoice:
    max_batch: int
    why: str  # one line for the start log: what was measured and the rule


def choose_max_batch(estimate: Callable[[int], float], measured: Sequence[int], budget_s: float) -> BatchChoice:
    """The largest measured size whose `estimate` (seconds) fits twice in `budget_s`; 1 when none does.

    Example:
        >>> choose_max_batch(lambda b: 0.001 + 0.0005 * b, [1, 2, 4, 8, 16, 32], 0.017).max_batch
        8
    """
    if not measured:
        raise ValueError("choose_max_batch: no batch size was measured")
    if budget_s <= 0:
        raise ValueError(f"choose_max_batch: the budget must be > 0 s, got {budget_s}")
    sizes = sorted(set(int(b) for b in measured))
    ok = [b for b in sizes if fits(estimate(b), budget_s)]
    budget_ms = budget_s * 1e3
    if not ok:
        return BatchChoice(1, f"even batch 1's estimate is {estimate(1) * 1e3:.1f} ms, over half the {budget_ms:g} ms "
                              f"budget: most frames will miss their deadline; raise budget.latency_ms or run a "
                              f"smaller model")
    b = ok[-1]
    over = next((s for s in sizes if s > b), None)
    why = (f"batch {b}'s estimate is {estimate(b) * 1e3:.1f} ms: the largest measured batch that runs twice within the "
           f"{budget_ms:g} ms budget (a frame may wait for the batch ahead of it, then run in its own)")
    if over is not None:
        why += f"; batch {over}'s is {estimate(over) * 1e3:.1f} ms"
    else:
        why += f"; {b} is the largest size measured (models.<pool>.max_batch: auto measures up to {sizes[-1]})"
    return BatchChoice(b, why)
