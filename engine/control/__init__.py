"""The control plane: the `vidar` command (cli.py), the asyncio runtime (runtime.py: signals, status line,
offline completion) and the control socket (control_socket.py).

Why a package: it talks to users and sockets and never decodes or runs a model; it reaches the engine
through the core's typed requests. May import: everything below it (engine.core and its dependencies,
engine.view, engine.cluster is above it).
"""
