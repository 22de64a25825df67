"""Conversation memory: a conversation an agent keeps as one exact cache (:class:`kvedit.Memory`,
in :mod:`kvedit.memory.conversation`), its prompt formats (:mod:`kvedit.memory.rendering`),
per-message records (:mod:`kvedit.memory.records`) and answering (:mod:`kvedit.memory.answering`).
"""
