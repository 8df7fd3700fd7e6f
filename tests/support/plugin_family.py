"""A model family with no model, registered by tests to show that pools are plug-ins."""

from engine.models.registry import PoolSpec


def build_pool(cfg, *, models=None, factory=None):
    return PoolSpec("null2", models, factory, cfg.max_batch)
