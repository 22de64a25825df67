"""Whether a state can run on a model: made by it, and its cache shaped as the model's
(:func:`state_fits_model`, assembling the problems :mod:`kvedit.state_fit` finds). Import it
from :mod:`kvedit.checks`.
"""

from __future__ import annotations

from .. import state_fit
from ..errors import CacheMismatchError, KVEditError

__all__ = ["state_fits_model"]


def _model_layers(model):
    """The gate's per-layer facts (window, KV heads, key/value head sizes, from its probe)."""
    from ..runtime import spec

    return spec(model).layers


def state_fits_model(
    state,
    model,
    tokenizer=None,
    *,
    fingerprints: bool = True,
    deep: bool = False,
    error: type[KVEditError] = CacheMismatchError,
) -> None:
    """Check that ``state`` can run on ``model``: made by it, and shaped as its cache is.

    Checks (shapes only, cheap): the model and tokenizer fingerprints (when ``fingerprints``;
    the tokenizer's only when ``tokenizer`` is given), one layer per decoder layer with the
    model's sliding windows, keys and values ``[batch, kv_heads, n, head_dim]`` with the model's
    KV heads and head size, ``token_index``/``positions`` of length ``n``, a bias
    ``[batch, 1 | kv_heads | heads, n]``, sliding layers holding at most ``window`` entries,
    and ``token_ids``/``offsets``/``position_ids``/``last_logits`` of matching sizes. With
    ``deep``, also the values: token ids inside the vocabulary, ``token_index`` in
    ``[-1, n_tokens)``, positions before ``next_position``, offsets inside the text.

    Raises:
        error: (default :class:`~kvedit.errors.CacheMismatchError`) with every problem found,
            up to five. :func:`kvedit.load_state` passes
            :class:`~kvedit.errors.CorruptCacheError`: a file whose fingerprint names the
            model but whose structure does not fit it has lying metadata.
    """
    problems: list[str] = []
    if fingerprints:
        state_fit.check_fingerprints(state, model, tokenizer)
    specs = _model_layers(model)
    heads = getattr(model.config.get_text_config(), "num_attention_heads", None)
    if len(state.layers) != len(specs):
        problems.append(f"{len(state.layers)} layers, the model has {len(specs)}")
    n_tokens = int(state.token_ids.shape[0]) if state.token_ids.ndim == 1 else -1
    for i, (layer, ls) in enumerate(zip(state.layers, specs, strict=False)):
        keys, values = tuple(layer.kv_shape), tuple(layer.value_shape)
        if len(keys) != 4 or len(values) != 4:
            problems.append(f"layer {i}: keys {keys} / values {values} are not 4-D")
            continue
        problems += state_fit.layer_problems(i, layer, ls, heads)
        if deep and keys[2] and n_tokens >= 0:
            problems += state_fit.layer_value_problems(i, layer, n_tokens, state.next_position)
        if len(problems) >= 5:
            break
    problems += state_fit.token_shape_problems(state, n_tokens)
    n_in, n_out = state_fit.vocab_sizes(model)
    if state.last_logits.ndim != 1 or (n_out is not None and state.last_logits.numel() != n_out):
        problems.append(
            f"last_logits {tuple(state.last_logits.shape)}, the model's vocabulary is {n_out}"
        )
    if deep and not problems and n_tokens > 0:
        problems += state_fit.token_value_problems(state, n_in)
    if problems:
        name = getattr(model, "name_or_path", None) or type(model).__name__
        raise error(f"the cache does not fit the model {name!r}: " + "; ".join(problems[:5]))
