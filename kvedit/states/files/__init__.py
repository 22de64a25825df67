"""State files: the format (:mod:`.format`), writing (:mod:`.write`) and reading (:mod:`.read`).

The package imports nothing itself: :mod:`kvedit.states.state` imports the writer, and the reader
imports :mod:`kvedit.states.state`. ``kvedit.load_state`` and ``KVState.save`` are the entry points.
"""
