"""Steering: ``kvedit.steer``, a bias on the model's attention to chosen spans while it runs.

- :mod:`.session`: ``steer`` and the :class:`Steering` context it returns.
- :mod:`.plan`: what a steer applies (its configuration, the focus request, the span plan that
  finds the spans in each forward's input ids).

The package imports nothing itself; import from the modules.
"""
