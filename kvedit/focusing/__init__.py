"""Automatic focus: which passages a question points at, and whether to edit them.

- :mod:`.choice`: ``kvedit.focus`` / ``focus_text`` / ``choose`` and the :class:`Focus` they return.
- :mod:`.scoring`: scoring passages by the attention the question gives them, and abstaining.
- :mod:`.guard`: do-no-harm guards that keep the unedited answer where the edit may hurt.
- :mod:`.passages`: cutting a captured text into the passages focus scores.
- :mod:`.readout`: ``attention_share``, the attention a continuation gives each span.
- :mod:`.sizing`: strengths in nats, and how a bias relates to attention shares and PASTA's α.

The package imports nothing itself; import from the modules.
"""
