"""Fence: the one guard against threads the watchdog gave up on.

A seat that runs work on a thread (a worker slot, the output stage) has a Fence. A thread takes a
ticket (the current generation) when it starts; work started under generation g commits only
while g is current. When the watchdog gives up on a thread (hung, dead, or taken back by an
abort) it ends the generation: whatever that thread finishes later is void, and the thread that
replaces it starts under the next one.

Why a generation and not a flag per thread: the seat outlives its threads, and a late thread must
be told apart from its successor without knowing it. Not locked itself: ending a generation, and
checking it then committing, are done under the same lock (the pool's ledger lock), which makes
the check and the commit one step.
"""

from __future__ import annotations


class Fence:
    __slots__ = ("_generation",)

    def __init__(self) -> None:
        self._generation = 0  # the current generation: the only one whose work may commit

    def ticket(self) -> int:
        """The generation a thread starting now works under."""
        return self._generation

    def admits(self, ticket: int) -> bool:
        """Work started under `ticket` may commit (caller holds the lock it commits under)."""
        return ticket == self._generation

    def end(self) -> None:
        """The watchdog gives up on the current thread: its work never commits from now on."""
        self._generation += 1
