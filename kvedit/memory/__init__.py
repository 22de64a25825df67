"""Conversation memory: a conversation an agent keeps as one exact cache.

- :mod:`.conversation`: :class:`kvedit.Memory` itself (add, ask, save, load, explain).
- :mod:`.held`: what a memory holds at one moment, replaced whole, and the scores an arrival
  policy keeps beside the cache.
- :mod:`.rendering`: how a conversation becomes token ids (the prompt formats ``chat`` and
  ``plain``, by name).
- :mod:`.answering`: decoding an answer and committing its decoded K/V.
- :mod:`.records`: what is recorded of each message (:class:`~kvedit.memory.records.Turn`).
- :mod:`.explaining`: what a memory holds and did, in words.
- :mod:`.files`: a memory in one sealed state file; :mod:`.attached`: that file's attachment,
  every field checked at load.
- :mod:`.budget`: how much a memory may hold and when a round forgets.
- :mod:`.forgetting`: the round, and the policies (every registered scorer).
- :mod:`.protection`: the system messages a round never forgets.
- :mod:`.quantizing`: older messages held in low bits (``quantize=``).

The package imports nothing itself; import from the modules.
"""
