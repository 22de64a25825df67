"""What in a state does not fit a model: the checks of :func:`kvedit.checks.state_fits_model`.

Each ``*_problems`` function returns the problems it finds, as short phrases naming the layer
or field, the value found and the model's (empty when none); :func:`check_fingerprints` raises
at once, since a state made by another model or tokenizer needs no further diagnosis.
"""

from __future__ import annotations

from .errors import CacheMismatchError


def vocab_sizes(model) -> tuple[int | None, int | None]:
    """``(input vocabulary, output vocabulary)`` of ``model``, None where unknown."""
    n_in = n_out = None
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None and getattr(emb, "weight", None) is not None:
        n_in = int(emb.weight.shape[0])
    try:
        out = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        out = None
    if out is not None and getattr(out, "weight", None) is not None:
        n_out = int(out.weight.shape[0])
    return n_in, n_out


def check_fingerprints(state, model, tokenizer) -> None:
    """Raise :class:`~kvedit.errors.CacheMismatchError` when ``state`` was made by another
    model, or by another tokenizer than ``tokenizer`` (when given)."""
    from .fingerprint import model_fingerprint, tokenizer_fingerprint

    if model_fingerprint(model) != state.model_fingerprint:
        raise CacheMismatchError(
            f"this cache was made by another model: model fingerprint "
            f"{model_fingerprint(model)} != state's {state.model_fingerprint} "
            f"(model {getattr(model, 'name_or_path', '?')!r})"
        )
    if tokenizer is not None and tokenizer_fingerprint(tokenizer) != state.tokenizer_fingerprint:
        raise CacheMismatchError(
            f"this cache was made by another tokenizer: tokenizer fingerprint "
            f"{tokenizer_fingerprint(tokenizer)} != state's {state.tokenizer_fingerprint}"
        )


def layer_problems(i: int, layer, ls, heads: int | None) -> list[str]:
    """What in layer ``i`` (keys and values 4-D) does not fit the model's layer ``ls``: KV heads,
    head sizes, window, ``token_index``/``positions`` ``[n]``, bias ``[b, 1 | h | heads, n]``."""
    problems = []
    keys, values = tuple(layer.kv_shape), tuple(layer.value_shape)
    window = ls.window
    b, h, n, d = keys
    if h != ls.kv_heads:
        problems.append(f"layer {i}: {h} KV heads, the model has {ls.kv_heads}")
    if d != ls.key_dim:
        problems.append(f"layer {i}: key head_dim {d}, the model has {ls.key_dim}")
    if values[:3] != (b, h, n):
        problems.append(f"layer {i}: values {values} do not match keys {keys}")
    elif values[3] != ls.value_dim:
        problems.append(f"layer {i}: value head_dim {values[3]}, the model has {ls.value_dim}")
    if layer.window != window:
        problems.append(f"layer {i}: window {layer.window}, the model's is {window}")
    elif window is not None and n > window:
        problems.append(f"layer {i}: {n} entries in a sliding window of {window}")
    for field in ("token_index", "positions"):
        shape = tuple(getattr(layer, field).shape)
        if shape != (n,):
            problems.append(f"layer {i}: {field} {shape} for {n} entries")
    bias = layer.bias
    if bias is not None:
        ok_heads = {1, h, heads} - {None}
        if bias.ndim != 3 or bias.shape[0] != b or bias.shape[1] not in ok_heads:
            problems.append(f"layer {i}: bias {tuple(bias.shape)} for keys {keys}")
        elif bias.shape[2] != n:
            problems.append(f"layer {i}: bias of {bias.shape[2]} entries for {n}")
    return problems


def layer_value_problems(i: int, layer, n_tokens: int, next_position: int) -> list[str]:
    """Layer ``i``'s ``token_index`` outside ``[-1, n_tokens)`` or positions outside
    ``[0, next_position)`` (the layer holds at least one entry)."""
    problems = []
    index, positions = layer.held_entries()
    if not len(index):
        return problems
    if int(index.min()) < -1 or int(index.max()) >= n_tokens:
        problems.append(f"layer {i}: token_index outside [-1, {n_tokens})")
    if int(positions.min()) < 0 or int(positions.max()) >= next_position:
        problems.append(f"layer {i}: positions outside [0, {next_position})")
    return problems


def token_shape_problems(state, n_tokens: int) -> list[str]:
    """``token_ids`` not 1-D (``n_tokens`` -1), or ``offsets`` not ``[n_tokens, 2]`` or
    ``position_ids`` not ``[n_tokens]``."""
    if n_tokens < 0:
        return [f"token_ids {tuple(state.token_ids.shape)} are not 1-D"]
    problems = []
    if tuple(state.offsets.shape) != (n_tokens, 2):
        problems.append(f"offsets {tuple(state.offsets.shape)} for {n_tokens} tokens")
    if tuple(state.position_ids.shape) != (n_tokens,):
        problems.append(f"position_ids {tuple(state.position_ids.shape)} for {n_tokens} tokens")
    return problems


def token_value_problems(state, n_in: int | None) -> list[str]:
    """Token ids outside the vocabulary of ``n_in``, offsets outside the text, position ids
    outside ``[0, next_position)`` (the state holds at least one token, all shapes fit)."""
    problems = []
    ids = state.token_ids
    if int(ids.min()) < 0 or (n_in is not None and int(ids.max()) >= n_in):
        problems.append(f"token ids outside the model's vocabulary of {n_in}")
    offsets = state.offsets
    if (
        int(offsets.min()) < 0
        or int(offsets.max()) > len(state.text)
        or bool((offsets[:, 0] > offsets[:, 1]).any())
    ):
        problems.append(f"offsets outside the text ({len(state.text)} chars)")
    if int(state.position_ids.max()) >= state.next_position or int(state.position_ids.min()) < 0:
        problems.append(f"position_ids outside [0, next_position={state.next_position})")
    return problems
