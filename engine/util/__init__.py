"""Helpers with no engine state: thread helpers (threads.py) and the heap's arena cap (memory.py).

Why a package: these are used by every layer, so they sit below all of them. May import: engine.errors.
"""
