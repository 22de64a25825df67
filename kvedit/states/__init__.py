"""The state: a captured KV cache and everything that makes, runs and stores one.

- :mod:`.state`: :class:`~kvedit.states.state.KVState` (per-layer K/V, token ids and offsets,
  positions, history) and its methods (extend, generate, logits, save).
- :mod:`.view`: :class:`~kvedit.states.view.StateView`, the read-only protocol the modules
  below :mod:`.state` type a state against (and :class:`~kvedit.states.view.LastInput`).
- :mod:`.stamps`: the tensors' version counters as built, so an in-place write is detected.
- :mod:`.capturing`: building a state by running the model (``capture``, ``capture_tokens``).
- :mod:`.passes`: forward passes over a state's cache (run tokens on top, recompute the last
  input).
- :mod:`.continuing`: continuing from a state (run, logits, token log-probabilities, answer,
  extend), the work of :class:`KVState`'s methods.
- :mod:`.decoding`: decoding from a state (``Answer``, ``Decoder``, EOS ids, ``Sampling``).
- :mod:`.room`: whether what a call adds fits the positions left (a text refused by its
  characters before it is tokenized).
- :mod:`.observer`: the one attention observer, a bias plan that records attention probabilities.
- :mod:`.files`: the state-file format, writer and reader (one version of a file, one open).

The package imports nothing itself; import from the modules.
"""
