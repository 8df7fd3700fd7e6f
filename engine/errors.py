"""Typed errors, in two tiers.

Recoverable errors hit one frame or one stream and are reported as events and counters;
the engine keeps running. Engine-dead errors stop everything and exit non-zero.
"""

from __future__ import annotations


class VidarError(Exception):
    """Base of every error vidar raises on purpose."""


class ConfigError(VidarError):
    """The configuration is invalid. The message names the key and the fix."""


class BindError(ConfigError):
    """A socket could not listen where the config says (most often: another program holds the port). `key`
    names the config key (publish.endpoint, control.endpoint, metrics.port, view.port), `endpoint` what was
    asked for; the message says the fix. A port left at its default moves instead (engine/security/ports.py)."""

    def __init__(self, key: str, endpoint: str, message: str):
        super().__init__(message)
        self.key, self.endpoint = key, endpoint


class WeightsError(VidarError):
    """Model weights could not be obtained or do not fit the model."""


class SourceError(VidarError):
    """A stream could not be opened or read. Recoverable: affects that stream only."""

    def __init__(self, stream: str, message: str):
        super().__init__(f"stream {stream!r}: {message}")
        self.stream = stream
        self.reason = message


class SourceOpenError(SourceError):
    """The stream's URL or file could not be opened (missing, not a video, unreachable)."""


class ControlError(VidarError):
    """A control request was malformed, named something unknown, or was refused (admission limits)."""


class ModelError(VidarError):
    """A model raised while running a batch. Recoverable: the batch's frames fail."""


class EngineDeadError(VidarError):
    """Unrecoverable: the engine stops, every stream gets an eos, the process exits non-zero."""
