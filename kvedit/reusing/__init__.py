"""Reuse: continue from stored caches instead of prefilling again.

- :mod:`.prefix`: ``kvedit.reuse``, continue from the longest stored prefix of a prompt.
- :mod:`.blending`: ``kvedit.blend``, build one cache from separately cached parts (CacheBlend).
- :mod:`.blend_rules`: the selection and correction rules ``blend`` takes, one keyword each.

The package imports nothing itself; import from the modules.
"""
