"""The rules every socket vidar opens obeys: which binds need CURVE or a token (binds.py), the CURVE
keys themselves (keys.py), and which taken ports may move to a free one (ports.py).

Why a package of its own: the config refuses an exposed socket when it is read, and the publisher, the
control socket, the view, /metrics and the cluster head all apply the same rule, so it sits below all of
them. May import: engine.errors.
"""
