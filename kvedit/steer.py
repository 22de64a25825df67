"""Deprecated as a module: `kvedit.steer` is the function (`kvedit.steer(...)`); the module is
now `kvedit.steering`. Importing from this path warns and forwards; calling it calls the function."""

from .deprecation import moved_module

moved_module(__name__, "kvedit.steering", call="kvedit.steering.steer")
