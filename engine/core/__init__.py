"""The engine core: the Engine facade (engine.py), the one thread that owns the engine's state (loop.py),
the typed requests other threads send it (requests.py), and the stream table it owns (stream_table.py).

Why a package: all state changes happen here, between steps, on one thread; everything else asks.
May import: everything below it (engine.executor and what that may import, engine.view's data side).
"""
