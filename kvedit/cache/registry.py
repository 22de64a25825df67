"""The registry of cache-layer classes, by the ``kind`` name they are stored under."""

from __future__ import annotations

from ..errors import CorruptCacheError
from ..registry import Registry

LAYER_CLASSES: Registry[type] = Registry("cache layer kind", error=CorruptCacheError)
"""Stored ``kind`` -> layer class (a :class:`kvedit.registry.Registry`; an unknown kind in a
file is a :class:`~kvedit.errors.CorruptCacheError`)."""


def register_layer(cls: type) -> type:
    """Class decorator: make ``cls`` (a :class:`~kvedit.cache.LayerKV` subclass with a unique
    ``kind``) known to storage and the store.

    Raises:
        TypeError: ``cls`` has no ``kind`` of its own.
        InvalidInputError: its ``kind`` is taken by another class.
    """
    kind = cls.__dict__.get("kind")
    if not isinstance(kind, str) or not kind:
        raise TypeError(f"{cls.__name__} needs a class attribute kind: str")
    return LAYER_CLASSES.register(kind, cls)


def layer_class(kind: str) -> type:
    """The class registered under ``kind``; CorruptCacheError for an unknown one."""
    return LAYER_CLASSES.lookup(kind)
