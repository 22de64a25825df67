"""Errors raised by kvedit. Every error is a :class:`KVEditError`."""

from __future__ import annotations


class KVEditError(Exception):
    """Base class of every error kvedit raises on purpose."""


class CacheMismatchError(KVEditError):
    """A cache (or projector) was used with a model or tokenizer it was not made by."""


class CorruptCacheError(KVEditError):
    """A stored cache file is truncated, corrupted, a pickle, or otherwise unreadable."""


class SpanNotFoundError(KVEditError, LookupError):
    """A span to edit does not occur in the text it was searched in."""


class UnsupportedModelError(KVEditError):
    """The model's architecture cannot be captured or edited by kvedit."""


class ModelNotAvailableError(KVEditError):
    """A bundled model's weights are not installed; the message gives the pip command."""
