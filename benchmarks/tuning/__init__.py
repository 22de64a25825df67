"""Tuning tools: one-off measurements whose findings are written up in ``reports/``, kept runnable
so that a finding can be checked again (``python -m benchmarks.tuning.NAME --help``). Not the
suite a user runs (``benchmarks/README.md``); ``benchmarks/tuning/README.md`` says which report
each serves.

* ``focus_recheck``: an eval run's ``auto`` answered again by today's focus only where the rule
  for a passage holding all of a question's words may change an abstention.
* ``guard_words``: the support guard's verdicts on eval runs' answers under the prompt's own
  words and under the word list they replaced (tokenizer only).
* ``answer_prefix``: the tokens focus's edited answer shares with the unedited one where the
  edit was kept (what drafting the edited answer from the unedited one could skip).
"""
