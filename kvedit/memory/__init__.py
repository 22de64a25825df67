"""Conversation memory: a conversation an agent keeps as one exact cache (:class:`kvedit.Memory`,
in :mod:`kvedit.memory.conversation`), its prompt formats (:mod:`kvedit.memory.rendering`),
per-message records (:mod:`kvedit.memory.records`), answering (:mod:`kvedit.memory.answering`),
its file (:mod:`kvedit.memory.files`, every field checked at load by
:mod:`kvedit.memory.attached`), and forgetting under a budget (:mod:`kvedit.memory.forgetting`,
what it never forgets: :mod:`kvedit.memory.protection`).
"""
