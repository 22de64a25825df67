"""Answer many (state, continuation) pairs with vLLM doing the batching: :class:`VLLMAnswerer`.

Each state is realised by the rule of :mod:`~kvedit.integrations.vllm.servable` (exact, or
approximate and labelled when the answerer was built with ``approximate=True``; anything else is
refused before it is published) and published (:func:`~kvedit.integrations.vllm.publish_stock`)
under the answerer's root as it is submitted, so the caller can drop it. Files are named by
the state's digest, so states with the same token ids (``scale_keys`` keeps them) each get
their own file; :meth:`VLLMAnswerer.flush` sends the pending prompts (published ids +
continuation ids), each naming its state's digest, to vLLM in one ``generate`` call and returns
the answers in submission order: greedy, stopping exactly at the EOS ids kvedit's own decoding
stops at (vLLM's own EOS handling is off), decoded by the state's tokenizer as
:meth:`kvedit.KVState.answer` decodes. An answer differs from kvedit's only where vLLM's
arithmetic does, or where an edit's bias is realised approximately (:attr:`Served.exact`,
:attr:`Served.approximation`).

Every answer is checked against what the connector did (:func:`check_served`): a prompt vLLM
did not serve wholly from its own file (the digest it named), or whose load failed, raises
:class:`~kvedit.errors.CacheNotServedError` (its answer would not be the state's); nothing of a
failed flush is kept. Needs vLLM (the extra ``kvedit[vllm]``) unless an engine is given.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import CacheNotServedError, InvalidInputError
from ...states.decoding import eos_ids
from ...states.state import KVState
from .engines import engine
from .publishing import PublishedIds, kv_transfer_params, publish_stock
from .servable import realize

__all__ = ["Served", "VLLMAnswerer", "check_served"]


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
        digest: the digest of the state the answer was served from (its approximation step
            included).
        approximation: the parameters of the ``Step("approximation", ...)`` the state was
            labelled with (None when exact).
    """

    text: str
    token_ids: list[int]
    served: int
    prompt_tokens: int
    exact: bool
    seconds: float
    digest: str = ""
    approximation: dict[str, Any] | None = None


@dataclass
class _Job:
    """A submitted state, published."""

    ids: PublishedIds
    question: list[int]
    max_new_tokens: int
    approximation: dict[str, Any] | None
    seconds: float

    @property
    def name(self) -> str:
        return self.ids.path.name


def check_served(output: Any, file_name: str, published: int, digest: str | None = None) -> int:
    """How many prompt tokens vLLM served from the file ``file_name`` (``published`` ids, named
    by ``digest``) for one ``RequestOutput``; raises unless it served exactly those, from that
    file, and echoed that digest.

    Raises:
        CacheNotServedError: the request ended with an error (the connector refused it, or a
            worker could not load the file), the connector matched another file or digest, or
            it served another count.
    """
    outputs = getattr(output, "outputs", None) or []
    if outputs and outputs[0].finish_reason == "error":
        raise CacheNotServedError(
            f"vLLM ended the request for {file_name} with an error (the connector refused it or "
            "a worker could not load its published cache; see the connector's log lines)"
        )
    outcome = (getattr(output, "kv_transfer_params", None) or {}).get("kvedit") or {}
    got = (outcome.get("file"), outcome.get("published"), outcome.get("served"))
    echoed = digest is None or outcome.get("digest") == digest
    if got != (file_name, published, published) or not echoed:
        raise CacheNotServedError(
            f"vLLM did not serve the prompt from {file_name} ({published} tokens"
            f"{f', digest {digest}' if digest else ''}): the connector reported "
            f"{outcome or 'nothing'}; its answer is not the state's"
        )
    return published


class VLLMAnswerer:
    """A vLLM engine answering kvedit states (see the module doc).

    Args:
        model, tokenizer: the model the states were captured with (as :func:`kvedit.load_model`
            returns them); vLLM loads the same weights from the model's folder.
        root: where states are published; a fresh temporary folder (removed by :meth:`close`)
            when None.
        llm: an engine :func:`~kvedit.integrations.vllm.engine` built for ``root``; by
            default one is built here.
        approximate: serve states vLLM realises only approximately, labelled (see
            :mod:`~kvedit.integrations.vllm.servable`); by default they are refused at
            :meth:`submit`.
        **llm_kwargs: passed to :func:`~kvedit.integrations.vllm.engine` (and ``vllm.LLM``).
            ``load_failure`` can only be ``"fail"``: with ``"recompute"`` a failed load would
            answer the published ids as text.

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        root: str | Path | None = None,
        *,
        llm: Any = None,
        approximate: bool = False,
        **llm_kwargs: Any,
    ) -> None:
        if llm_kwargs.get("load_failure", "fail") != "fail":
            raise InvalidInputError(
                "VLLMAnswerer needs load_failure='fail': a recomputed load would answer the "
                "published ids as text, not from the state"
            )
        if llm is not None and root is None:
            raise InvalidInputError("an engine passed as llm= needs the root it serves")
        self.tokenizer = tokenizer
        self.approximate = bool(approximate)
        self.stop_ids = sorted(eos_ids(model, tokenizer))
        self._jobs: list[_Job] = []
        self._own_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="kvedit-answer-") if root is None else root)
        self.start_seconds = 0.0
        """Seconds the engine took to start (0 when it was given)."""
        if llm is None:
            t0 = time.perf_counter()
            try:
                llm = engine(model, self.root, **llm_kwargs)
            except BaseException:
                self._remove_root()
                raise
            self.start_seconds = time.perf_counter() - t0
        self.llm = llm

    def submit(self, state: KVState, continuation: str, max_new_tokens: int) -> None:
        """Queue ``state``, continued by ``continuation``, for :meth:`flush`; it is realised by
        the rule and published now.

        Raises:
            InvalidInputError: ``max_new_tokens`` below 1, an empty continuation (vLLM would
                compute the last published token itself, from its id), or a state vLLM
                realises only approximately (without ``approximate=True``) or not at all
                (nothing is published).
            CorruptCacheError, StorageError, ...: what :func:`to_stock` or publishing raise;
                the queue is then dropped.
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise InvalidInputError(f"max_new_tokens must be an int, not {max_new_tokens!r}")
        if max_new_tokens < 1:
            raise InvalidInputError(f"max_new_tokens must be >= 1, not {max_new_tokens}")
        question = list(state.encode(continuation)) if continuation else []
        if not question:
            raise InvalidInputError("the continuation is empty: vLLM must answer after the cache")
        t0 = time.perf_counter()
        try:
            labelled, stock = realize(state, approximate=self.approximate)
            same = next((j for j in self._jobs if j.ids.digest == stock.digest), None)
            if same is not None:  # the same state queued: its file serves both
                ids = same.ids
            else:
                ids, _, _ = publish_stock(stock, self.root, approximate=self.approximate)
        except BaseException:
            self._drop()
            raise
        last = labelled.history.steps[-1] if labelled.history.steps else None
        approximation = (
            dict(last.params) if last is not None and last.kind == "approximation" else None
        )
        seconds = time.perf_counter() - t0
        self._jobs.append(_Job(ids, question, max_new_tokens, approximation, seconds))

    def flush(self) -> list[Served]:
        """Answer every queued state; returns their answers in the order they were submitted.

        Raises:
            CacheNotServedError: vLLM did not serve a prompt from its state's file (nothing of
                this flush is returned; the queue is dropped).
        """
        jobs, self._jobs = self._jobs, []
        if not jobs:
            return []
        try:
            return self._generate(jobs)
        except BaseException:
            self._jobs = jobs
            self._drop()
            raise

    def _sampling(self, max_new_tokens: int, digest: str) -> Any:
        """Greedy sampling that stops exactly where kvedit's decoding stops, naming the
        published cache's digest."""
        from vllm import SamplingParams

        return SamplingParams(
            temperature=0.0,
            max_tokens=max_new_tokens,
            ignore_eos=True,  # vLLM's own EOS ids may differ from kvedit's; stop at kvedit's
            stop_token_ids=self.stop_ids,
            skip_special_tokens=True,
            extra_args={"kv_transfer_params": kv_transfer_params(digest)},
        )

    def _generate(self, jobs: list[_Job]) -> list[Served]:
        t0 = time.perf_counter()
        try:
            outs = self.llm.generate(
                [{"prompt_token_ids": list(j.ids) + j.question} for j in jobs],
                [self._sampling(j.max_new_tokens, j.ids.digest) for j in jobs],
                use_tqdm=False,
            )
        finally:
            for j in jobs:
                j.ids.path.unlink(missing_ok=True)
        share = (time.perf_counter() - t0) / len(jobs)
        answers = []
        for j, out in zip(jobs, outs, strict=True):
            served = check_served(out, j.name, len(j.ids), j.ids.digest)
            tokens = list(out.outputs[0].token_ids)
            while tokens and tokens[-1] in self.stop_ids:
                tokens.pop()
            answers.append(
                Served(
                    text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                    token_ids=tokens,
                    served=served,
                    prompt_tokens=len(j.ids) + len(j.question),
                    exact=j.ids.exact,
                    seconds=j.seconds + share,
                    digest=j.ids.digest,
                    approximation=j.approximation,
                )
            )
        return answers

    def _drop(self) -> None:
        """Forget the queue and remove its published files."""
        for job in self._jobs:
            job.ids.path.unlink(missing_ok=True)
        self._jobs = []

    def _remove_root(self) -> None:
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def close(self) -> None:
        """Drop the queue, stop the engine's processes, remove a temporary root."""
        self._drop()
        llm, self.llm = self.llm, None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self._remove_root()

    def __enter__(self) -> VLLMAnswerer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
