"""Errors raised by kvedit. Every error is a :class:`KVEditError`.

Every error kvedit raises on purpose is defined here, so ``except kvedit.errors.KVEditError``
catches all of them. Errors about bad arguments also derive from the built-in exception a caller
would expect (``ValueError``, ``TypeError``, ``KeyError``, ``TimeoutError``, ...), so code written
against the built-in classes keeps working.

==============================  ===============================================================
class                           raised when
==============================  ===============================================================
``InvalidInputError``           an argument has a bad value (``ValueError``)
``InvalidTypeError``            an argument has the wrong type (``TypeError`` and ``ValueError``)
``EmptySelectionError``         spans or layers select nothing to edit (``ValueError``)
``NotACaptureError``            an edited state given where only a plain capture will do
``SpanNotFoundError``           a span is not in the text (``LookupError``)
``CacheMismatchError``          a cache is used with a model or tokenizer it was not made by
``ModelNotAttachedError``       a state needs its model and has none (also ``ValueError``)
``CorruptCacheError``           a stored file is truncated, corrupted, a pickle, inconsistent
``StateAlteredError``           a state's tensors were changed behind kvedit's back
``StorageError``                a file cannot be written (``OSError``)
``FileChangedError``            a file changed since it was read (another writer; ``OSError``)
``StoreUnavailableError``       a KVStore's directory cannot be used (``OSError``)
``EntryNotFoundError``          a KVStore key names no entry (``KeyError``)
``StoreLockTimeout``            another writer held a KVStore's lock too long (``TimeoutError``)
``NestedSteeringError``         a second steering of one model in one context (``RuntimeError``)
``UnsupportedModelError``       the model's architecture cannot be captured or edited
``TemplateError``               a prompt format a Memory cannot follow exactly (also ``ValueError``)
``ModelNotAvailableError``      a bundled model's weights are not installed
``UnknownModelError``           a model name names no model (also ``InvalidInputError``)
``InvalidExampleError``         an evaluation example is malformed (``ValueError``)
``KernelInputError``            a tensor handed to a kvedit kernel is malformed (``ValueError``)
``TritonUnavailableError``      Triton cannot run here (``ImportError``)
``VLLMUnavailableError``        vLLM is not installed (``ImportError``)
``CacheNotServedError``         vLLM answered without the published cache (``RuntimeError``)
==============================  ===============================================================
"""

from __future__ import annotations


class KVEditError(Exception):
    """Base class of every error kvedit raises on purpose."""


# ------------------------------------------------------------------------ bad arguments


class InvalidInputError(KVEditError, ValueError):
    """An argument has a value kvedit cannot use (out of range, empty, not finite, ...)."""


class NotACaptureError(InvalidInputError):
    """A state that is not a plain capture where only one will do: ``KVStore.put`` (its key is a
    function of the token ids, which say nothing of edits). The message names the first
    transformation in the state's history."""


class InvalidTypeError(InvalidInputError, TypeError):
    """An argument has the wrong type (a bool for a number, None for a text, a dict for spans).

    It is both a ``TypeError`` and (through :class:`InvalidInputError`) a ``ValueError``, so
    callers that caught ``ValueError`` for bad arguments before still catch it.
    """


class EmptySelectionError(InvalidInputError):
    """Spans, layers or heads select nothing, so an edit would silently do nothing."""


class SpanNotFoundError(KVEditError, LookupError):
    """A span to edit does not occur in the text it was searched in."""


# ------------------------------------------------------------------------ caches and models


class CacheMismatchError(KVEditError):
    """A cache (or projector) was used with a model or tokenizer it was not made by."""


class ModelNotAttachedError(CacheMismatchError, ValueError):
    """A state (or an op on it) needs the model and tokenizer, and none is attached."""


class CorruptCacheError(KVEditError):
    """A stored cache file is truncated, corrupted, a pickle, or otherwise unreadable, or its
    metadata does not describe its own tensors."""


class StateAlteredError(KVEditError, RuntimeError):
    """A state's tensors no longer agree with each other (they were changed in place)."""


class UnsupportedModelError(KVEditError):
    """The model's architecture cannot be captured or edited by kvedit."""


class TemplateError(UnsupportedModelError, ValueError):
    """A prompt format :class:`kvedit.Memory` cannot follow exactly: a chat template that
    rewrites earlier text (not append-only), or a message boundary that tokenizes differently
    once more text follows."""


class ModelNotAvailableError(KVEditError):
    """A bundled model's weights are not installed; the message gives the pip command."""


class UnknownModelError(ModelNotAvailableError, InvalidInputError):
    """A model name that is neither a registered name, a folder nor a ``.gguf`` file (a bad
    argument: the CLI exits 2)."""


class NestedSteeringError(KVEditError, RuntimeError):
    """A second plan was activated for a model that already has one in this context."""


# ------------------------------------------------------------------------ files and the store


class StorageError(KVEditError, OSError):
    """A file could not be written (disk full, permission denied, a directory in the way).

    ``errno`` and ``filename`` are those of the underlying ``OSError`` when there is one.
    """


class FileChangedError(StorageError):
    """A file is no longer the version its holder read or wrote last: another writer replaced
    it meanwhile (two chats saving one memory file), and writing it now would lose that
    writer's work. Nothing was written."""


class StoreUnavailableError(StorageError):
    """A :class:`~kvedit.KVStore`'s directory is gone and cannot be created again, or is not
    usable."""


class EntryNotFoundError(KVEditError, KeyError):
    """A :class:`~kvedit.KVStore` key names no stored entry."""

    def __str__(self) -> str:  # KeyError would show the repr of the message
        return str(self.args[0]) if self.args else ""


class StoreLockTimeout(KVEditError, TimeoutError):
    """Another writer held the store's lock for longer than the timeout."""


# ------------------------------------------------------------------------ evaluations, kernels


class InvalidExampleError(KVEditError, ValueError):
    """An example, or a line of an examples file, is malformed."""


class KernelInputError(KVEditError, ValueError):
    """A tensor handed to a kvedit kernel (or its reference) has the wrong shape or dtype."""


class TritonUnavailableError(KVEditError, ImportError):
    """Triton is not installed, or there is neither a CUDA device nor the Triton interpreter."""


class VLLMUnavailableError(KVEditError, ImportError):
    """vLLM is not installed (or not importable), so no engine can be built; the message names
    the extra to install."""


class CacheNotServedError(KVEditError, RuntimeError):
    """vLLM answered a prompt without loading (all of) its published kvedit cache (the connector
    refused it, or served fewer tokens), so the answer is not the edited cache's."""


__all__ = [
    "CacheNotServedError",
    "CacheMismatchError",
    "CorruptCacheError",
    "EmptySelectionError",
    "EntryNotFoundError",
    "FileChangedError",
    "InvalidExampleError",
    "InvalidInputError",
    "InvalidTypeError",
    "KVEditError",
    "KernelInputError",
    "ModelNotAttachedError",
    "ModelNotAvailableError",
    "NestedSteeringError",
    "NotACaptureError",
    "SpanNotFoundError",
    "StateAlteredError",
    "StorageError",
    "StoreLockTimeout",
    "StoreUnavailableError",
    "TemplateError",
    "TritonUnavailableError",
    "VLLMUnavailableError",
    "UnknownModelError",
    "UnsupportedModelError",
]
