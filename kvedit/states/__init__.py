"""The state: a captured KV cache and everything that makes, runs and stores one.

- :mod:`.state`: :class:`~kvedit.states.state.KVState` (per-layer K/V, token ids and offsets,
  positions, history) and its methods (extend, generate, logits, save).
- :mod:`.capturing`: building a state by running the model (``capture``, ``capture_tokens``).
- :mod:`.passes`: forward passes over a state's cache (run tokens on top, recompute the last input).
- :mod:`.decoding`: decoding from a state (``Answer``, ``Decoder``, EOS ids, sampling).
- :mod:`.observer`: the one attention observer, a bias plan that records attention probabilities.
- :mod:`.files`: the state-file format, writer and reader.

The package imports nothing itself; import from the modules.
"""
