"""In-place writes to a state's tensors, detected: the version counter of every tensor a state
holds, taken when the state is built and compared before a use that must see the state as it
was made (:meth:`kvedit.KVState.check_unaltered`).

A state is typed :class:`~kvedit.states.view.StateView` here (:mod:`kvedit.states.state`
imports this module); a layer is read through its attributes, whatever its class.
"""

from __future__ import annotations

import torch

from .view import StateView

__all__ = ["tensor_stamp"]


def _tensor_versions(prefix: str, obj, out: list) -> None:
    """``(name, version)`` of each tensor attribute of a layer ``obj`` (and of the objects it
    holds, one level down: a merged layer's shared directions), appended to ``out``."""
    for name, value in sorted(vars(obj).items()):
        if isinstance(value, torch.Tensor):
            out.append((f"{prefix}{name}", value._version))
        elif hasattr(value, "__dict__") and not isinstance(value, (type, torch.nn.Module)):
            for inner_name, inner in sorted(vars(value).items()):
                if isinstance(inner, torch.Tensor):
                    out.append((f"{prefix}{name}.{inner_name}", inner._version))


def tensor_stamp(state: StateView) -> tuple[tuple[str, int], ...]:
    """The version counter of every tensor a state holds, by name (``layer 3 keys``...):
    torch bumps a tensor's counter on each in-place write to it or to a view of it."""
    out: list[tuple[str, int]] = [
        (name, getattr(state, name)._version)
        for name in ("token_ids", "offsets", "position_ids", "last_logits")
    ]
    for i, layer in enumerate(state.layers):
        _tensor_versions(f"layer {i} ", layer, out)
    return tuple(out)
