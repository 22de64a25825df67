"""Deprecated as a module: `kvedit.blend` is the function (`kvedit.blend(...)`); the module is
now `kvedit.blending`. Importing from this path warns and forwards; calling it calls the function."""

from .deprecation import moved_module

moved_module(__name__, "kvedit.blending", call="kvedit.blending.blend")
