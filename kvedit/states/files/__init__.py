"""State files: the format (:mod:`.format`), writing (:mod:`.write`), reading (:mod:`.read`),
the seal that guards them (:mod:`.seal`) and one version of a file read through one open
(:mod:`.snapshot`).

The package imports nothing itself: :mod:`kvedit.states.state` imports the writer, and the reader
imports :mod:`kvedit.states.state`. ``kvedit.load_state`` and ``KVState.save`` are the entry points.
"""
