"""Deprecated: `kvedit.storage` is now `kvedit.statefiles.read` (state files live in :mod:`kvedit.statefiles`)."""

from .deprecation import moved_module

moved_module(__name__, "kvedit.statefiles.read")
