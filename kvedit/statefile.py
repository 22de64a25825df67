"""Deprecated: `kvedit.statefile` is now `kvedit.statefiles.write` (state files live in :mod:`kvedit.statefiles`)."""

from .deprecation import moved_module

moved_module(__name__, "kvedit.statefiles.write")
