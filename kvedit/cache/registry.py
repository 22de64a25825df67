"""The registry of cache-layer classes, by the ``kind`` name they are stored under."""

from __future__ import annotations

from ..errors import CorruptCacheError

LAYER_CLASSES: dict[str, type] = {}


def register_layer(cls: type) -> type:
    """Class decorator: make ``cls`` (a :class:`~kvedit.cache.LayerKV` subclass with a unique
    ``kind``) known to storage and the store."""
    kind = cls.__dict__.get("kind")
    if not isinstance(kind, str) or not kind:
        raise TypeError(f"{cls.__name__} needs a class attribute kind: str")
    LAYER_CLASSES[kind] = cls
    return cls


def layer_class(kind: str) -> type:
    """The class registered under ``kind``; CorruptCacheError for an unknown one."""
    try:
        return LAYER_CLASSES[kind]
    except KeyError:
        raise CorruptCacheError(
            f"unknown cache layer kind {kind!r} (known: {sorted(LAYER_CLASSES)})"
        ) from None
