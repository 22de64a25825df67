"""Automatic focus: which passages a question points at, and whether to edit them.

- :mod:`.choice`: ``kvedit.focus`` / ``focus_text`` / ``choose``: the choice, the edit, the guard.
- :mod:`.options`: their arguments, checked once at the entry (``FocusOptions``).
- :mod:`.result`: the :class:`~kvedit.focusing.result.Focus` they return.
- :mod:`.scoring`: scoring passages by the attention the question gives them, and abstaining.
- :mod:`.guard`: do-no-harm guards that keep the unedited answer where the edit may hurt.
- :mod:`.edits`: another edit of the chosen passages (``focus(edit=...)``), checked.
- :mod:`.primed`: the question's scoring pass, kept so the unedited answer does not run it again.
- :mod:`.passages`: cutting a captured text into the passages focus scores.
- :mod:`.readout`: ``attention_share``, the attention a continuation gives each span.
- :mod:`.sizing`: strengths in nats, and how a bias relates to attention shares and PASTA's α.
- :mod:`.words`: a text's words, and which of them tell one passage from another.

The package imports nothing itself; import from the modules.
"""
