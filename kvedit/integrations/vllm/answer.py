"""Answer many (state, continuation) pairs with vLLM doing the batching: :class:`VLLMAnswerer`.

Each state is published (:func:`~kvedit.integrations.vllm.publish_stock`) under a private root
as it is submitted, so the caller can drop it; :meth:`VLLMAnswerer.flush` sends every pending
prompt (published ids + continuation ids) to vLLM in one ``generate`` call and returns the
answers in submission order, greedy, decoded by the state's tokenizer exactly as
:meth:`kvedit.KVState.answer` decodes (stopping at the same EOS ids), so an answer differs from
kvedit's own only where vLLM's arithmetic does (or where an edit's bias is realised
approximately: :attr:`Served.exact`).

Two states with the same published token ids (``scale_keys`` keeps the ids) would share one
file: submitting the second flushes the first before its file is replaced. A prompt vLLM did
not serve wholly from its file raises :class:`~kvedit.errors.CacheNotServedError` (its answer
would be the unedited prompt's). Needs vLLM (the extra ``kvedit[vllm]``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import CacheNotServedError, InvalidInputError
from ...state import KVState, eos_ids
from . import files

__all__ = ["Served", "VLLMAnswerer"]


@dataclass(frozen=True)
class Served:
    """One answer.

    Attributes:
        text: the new tokens decoded (``skip_special_tokens=True``), EOS not included.
        token_ids: the new token ids, EOS not included.
        served: prompt tokens vLLM took from the published file.
        prompt_tokens: the prompt's length (published slots + continuation).
        exact: whether the published cache realises the state's edit exactly
            (:attr:`~kvedit.integrations.vllm.StockCache.exact`).
        seconds: this answer's share of the time: its publishing, plus the ``generate`` call
            it was answered in divided by the prompts in that call.
    """

    text: str
    token_ids: list[int]
    served: int
    prompt_tokens: int
    exact: bool
    seconds: float


@dataclass
class _Pending:
    ids: list[int]
    prompt: list[int]
    max_new_tokens: int
    exact: bool
    path: Path
    publish_seconds: float


class VLLMAnswerer:
    """A vLLM engine answering kvedit states (see the module doc).

    Args:
        model, tokenizer: the model the states were captured with (as :func:`kvedit.load_model`
            returns them); vLLM loads the same weights from the model's folder.
        root: where states are published; a fresh temporary folder (removed by :meth:`close`)
            when None.
        **llm_kwargs: passed to :func:`~kvedit.integrations.vllm.engine` (and ``vllm.LLM``).

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self, model, tokenizer, root: str | os.PathLike | None = None, **llm_kwargs: Any
    ) -> None:
        from . import engine

        self._own_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="kvedit-answer-") if root is None else root)
        t0 = time.perf_counter()
        self.llm = engine(model, self.root, **llm_kwargs)
        self.start_seconds = time.perf_counter() - t0
        """Seconds the engine took to start."""
        self.tokenizer = tokenizer
        self.stop_ids = sorted(eos_ids(model, tokenizer))
        self._pending: list[_Pending] = []
        self._done: list[Served] = []

    def submit(self, state: KVState, continuation: str, max_new_tokens: int) -> None:
        """Publish ``state`` and queue it, continued by ``continuation``, for :meth:`flush`."""
        from . import publish_stock
        from .stock import to_stock

        if max_new_tokens < 1:
            raise InvalidInputError(f"max_new_tokens must be >= 1, not {max_new_tokens}")
        t0 = time.perf_counter()
        stock = to_stock(state)
        seconds = time.perf_counter() - t0
        if any(p.path.name == files.file_name(stock.token_ids) for p in self._pending):
            self._run_pending()  # answer the earlier prompt before its file is replaced
        t0 = time.perf_counter()
        ids, stock, path = publish_stock(stock, self.root)
        question = state.encode(continuation) if continuation else []
        self._pending.append(
            _Pending(
                ids=ids,
                prompt=ids + list(question),
                max_new_tokens=max_new_tokens,
                exact=stock.exact,
                path=path,
                publish_seconds=seconds + time.perf_counter() - t0,
            )
        )

    def flush(self) -> list[Served]:
        """Answer every pending prompt; returns the answers not returned before, in the order
        their states were submitted."""
        self._run_pending()
        out, self._done = self._done, []
        return out

    def _run_pending(self) -> None:
        from vllm import SamplingParams

        pending, self._pending = self._pending, []
        if not pending:
            return
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=p.max_new_tokens,
                stop_token_ids=self.stop_ids,
                skip_special_tokens=True,
            )
            for p in pending
        ]
        t0 = time.perf_counter()
        try:
            outs = self.llm.generate(
                [{"prompt_token_ids": p.prompt} for p in pending], params, use_tqdm=False
            )
        finally:
            for p in pending:
                p.path.unlink(missing_ok=True)
        share = (time.perf_counter() - t0) / len(pending)
        for p, out in zip(pending, outs, strict=True):
            if out.outputs and out.outputs[0].finish_reason == "error":
                raise CacheNotServedError(
                    "vLLM ended a request with an error (a worker could not load its published "
                    "cache; see the connector's log lines)"
                )
            outcome = (out.kv_transfer_params or {}).get("kvedit", {})
            served = int(outcome.get("served", 0))
            if served < len(p.ids) - (len(p.prompt) == len(p.ids)):
                raise CacheNotServedError(
                    f"vLLM served {served} of the {len(p.ids)} published tokens of a prompt "
                    f"({outcome or 'no connector outcome'}); its answer is not the state's"
                )
            tokens = list(out.outputs[0].token_ids)
            while tokens and tokens[-1] in self.stop_ids:
                tokens.pop()
            self._done.append(
                Served(
                    text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                    token_ids=tokens,
                    served=served,
                    prompt_tokens=len(p.prompt),
                    exact=p.exact,
                    seconds=p.publish_seconds + share,
                )
            )

    def close(self) -> None:
        """Drop pending prompts and the engine (vLLM stops its workers when it is collected);
        remove a temporary root."""
        self._pending = []
        self.llm = None
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> VLLMAnswerer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
