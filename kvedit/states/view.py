"""What the modules under :mod:`kvedit.states.state` see of a state: :class:`StateView`.

:mod:`kvedit.states.state` builds :class:`~kvedit.states.state.KVState` on
:mod:`~kvedit.states.passes`, :mod:`~kvedit.states.decoding`, :mod:`~kvedit.states.room`,
:mod:`~kvedit.states.continuing` and :mod:`~kvedit.states.files.write`, which take a state as an
argument. They type it with
:class:`StateView`, the part of a state they read (a ``typing.Protocol`` that ``KVState``
satisfies), so none of them imports the module that imports them. :class:`LastInput`, the entry
a state's last logits follow, lives here for the same reason (``kvedit.states.state`` exports
it too).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, Self

import torch
from transformers import PreTrainedModel

from ..cache import LayerKV
from ..cache.adapter import CacheEntries
from ..provenance import History, Step

__all__ = ["LastInput", "StateView"]


class LastInput(NamedTuple):
    """The entry a state's ``last_logits`` follow: text token ``token_index`` at rotary
    ``position`` (its entries are those with that token index *and* that position; a re-read
    copy of a token is another entry than the token where it was first read)."""

    token_index: int
    position: int


class StateView(Protocol):
    """The attributes and methods of :class:`~kvedit.states.state.KVState` (see there) that the
    passes, decoding, the room check and the file writer use. Read-only: a state is frozen."""

    @property
    def layers(self) -> Sequence[LayerKV]: ...

    @property
    def token_ids(self) -> torch.Tensor: ...

    @property
    def offsets(self) -> torch.Tensor: ...

    @property
    def text(self) -> str: ...

    @property
    def position_ids(self) -> torch.Tensor: ...

    @property
    def next_position(self) -> int: ...

    @property
    def last_logits(self) -> torch.Tensor: ...

    @property
    def model_fingerprint(self) -> str: ...

    @property
    def tokenizer_fingerprint(self) -> str: ...

    @property
    def history(self) -> History: ...

    @property
    def last_input(self) -> LastInput | None: ...

    @property
    def model(self) -> PreTrainedModel | None: ...

    @property
    def tokenizer(self) -> object | None: ...

    @property
    def max_positions(self) -> int | None: ...

    @property
    def device(self) -> torch.device: ...

    def __len__(self) -> int: ...

    def require_model(self) -> tuple[PreTrainedModel, object]: ...

    def checked_model(self) -> tuple[PreTrainedModel, object]: ...

    def encode(self, text: str, name: str = "continuation", reserve: int = 0) -> list[int]: ...

    def check_room(
        self, n_tokens: int, reserve: int = 0, *, what: str = "continuation", n_chars=None
    ) -> None: ...

    def run(
        self, ids: Sequence[int], logits_to_keep: int = 0
    ) -> tuple[torch.Tensor, CacheEntries]: ...

    def replace(self, **changes: Any) -> Self: ...

    def with_step(self, step: Step) -> Self: ...
