"""Which engine decodes the answers of ``kvedit eval litm``: kvedit's own, or vLLM.

Both engines answer the same (example, method) pairs, from :func:`example_pairs`: one
:class:`~kvedit.evals.methods.ExampleContext` per example (its capture made once, before any
method's time counts), methods that need documents left out on examples without any, and the
pairs an earlier run answered (``--resume``, ``--reuse``) carrying that run's record. They
differ only in how a pending pair is answered:

``transformers`` (the default): every method answers itself (:meth:`Method.predict
<kvedit.evals.methods.Method.predict>`), one example after another, with kvedit's decoding on
the Hugging Face model.

``vllm``: each method only builds the state it answers from (:meth:`Method.answer_state
<kvedit.evals.methods.Method.answer_state>`: ``none``, ``oracle``, ``auto`` and ``reread``,
with any cache edit), kvedit publishes it as a stock-kernel cache
(:mod:`kvedit.integrations.vllm`), and vLLM answers ``batch`` examples' prompts at a time in
one ``generate`` call, loading the published caches through the kvedit connector. The capture
and the methods' own work (scoring documents, editing) still run in kvedit. A method that
answers another way (``closedbook``, ``steer``, compression methods) is refused before any
work. A record's ``seconds`` is the method's own time plus its share of the batch's vLLM time
(see :class:`~kvedit.integrations.vllm.answer.VLLMAnswerer`); it also has ``"exact"``, whether
the published cache realises the method's edit exactly. What vLLM serves follows one rule
(:mod:`kvedit.integrations.vllm.servable`): a state realised only approximately (an
``emphasize`` strength that is not ``log(r + 1)``, ``auto``'s per-layer strengths, biases on
sliding-window layers) is answered only with ``approximate=True`` (``--approximate``), and its
record then has ``"approximation"``, the parameters of the approximation step its state was
labelled with; otherwise the run stops at the first such state, before it is served.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any, TypeVar

from kvedit.errors import InvalidInputError, KVEditError
from kvedit.evals.methods import ExampleContext, Method
from kvedit.evals.prompts import plain_answer
from kvedit.evals.schema import Example, score
from kvedit.focusing.guard import SupportVerdict

if TYPE_CHECKING:
    from kvedit.integrations.vllm.answer import VLLMAnswerer

__all__ = [
    "ENGINES",
    "VLLM_BATCH",
    "VLLM_KV_CACHE_BYTES",
    "Pair",
    "check_engine",
    "example_pairs",
    "RECORDED_NOTES",
    "result_record",
    "run_on_transformers",
    "run_on_vllm",
    "take_recorded",
]

T = TypeVar("T")

ENGINES = ("transformers", "vllm")
"""What ``kvedit eval litm --engine`` accepts."""

VLLM_BATCH = 8
"""Examples whose prompts vLLM answers in one ``generate`` call (``--batch``)."""

VLLM_KV_CACHE_BYTES = 4 << 30
"""vLLM's KV cache for an evaluation on CPU (on a GPU vLLM sizes it itself): room for a batch
of edited long prompts."""


def check_engine(engine: str, methods: Sequence[Method], batch: int = VLLM_BATCH) -> str:
    """``engine`` if it can run every method here; checked before any model is loaded.

    Raises:
        InvalidInputError: an unknown engine, a method it cannot run, a ``batch`` below 1.
        VLLMUnavailableError: ``"vllm"`` and vLLM is not installed.
    """
    if engine not in ENGINES:
        raise InvalidInputError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise InvalidInputError(f"batch must be a whole number of examples >= 1, not {batch!r}")
    if engine != "transformers":
        cannot = [m.spec for m in methods if not m.answers_from_state]
        if cannot:
            raise InvalidInputError(
                f"--engine {engine} serves methods that answer from one state (none, oracle, "
                f"auto, reread with a cache edit); not {', '.join(cannot)}: run them with "
                "--engine transformers"
            )
        from kvedit.integrations.vllm import require_vllm

        require_vllm("--engine vllm (in a checkout: make vllm-setup, then .venv-vllm/bin/kvedit)")
    return engine


RECORDED_NOTES = ("auto_choice", "auto_verdict", "cache_bytes")
"""What a method leaves in ``ctx.notes`` that goes into its record (``chosen``, ``kept`` and
``support``, ``bytes``)."""


def take_recorded(notes: dict[str, Any]) -> dict[str, Any]:
    """The notes of :data:`RECORDED_NOTES` a method left, taken out of ``notes`` (so the next
    method on the example starts without them)."""
    return {key: notes.pop(key) for key in RECORDED_NOTES if key in notes}


def result_record(
    example: Example,
    spec: str,
    prediction: str,
    seconds: float,
    notes: dict[str, Any],
    prompt: str,
) -> dict:
    """One result record (see :func:`kvedit.evals.litm.run`), with what ``notes`` (from
    :func:`take_recorded`) holds."""
    if prompt == "plain":
        prediction = plain_answer(prediction)
    record = {
        "id": example.id,
        "example": example.digest(),  # what the id asked: --reuse and --resume match on it
        "method": spec,
        "gold_index": example.gold_index,
        "prediction": prediction,
        "correct": bool(score(example, prediction)),
        "seconds": round(seconds, 3),
    }
    chosen = notes.get("auto_choice")  # the documents auto/reread chose
    if chosen is not None:
        record["chosen"] = [int(i) for i in chosen]
    verdict = notes.get("auto_verdict")  # the guard's decision on that edit
    if verdict is not None:
        record["kept"] = bool(verdict.kept)  # False: the unedited state answered
        if isinstance(verdict, SupportVerdict):  # the share the support guard read
            record["support"] = round(float(verdict.support), 4)
    cache_bytes = notes.get("cache_bytes")  # a compression method's bytes
    if cache_bytes is not None:
        record["bytes"] = round(float(cache_bytes), 4)
    return record


@dataclass
class Pair:
    """One (example, method) pair of a run (:func:`example_pairs`).

    Attributes:
        example: the example.
        method: the method that answers it.
        ctx: the example's context, shared by every method on it.
        record: the record an earlier run made for the pair (``done``: ``--resume``,
            ``--reuse``), taken as is; ``None`` when the pair is to be answered.
    """

    example: Example
    method: Method
    ctx: ExampleContext
    record: dict | None = None

    def answer(self, how: Callable[[ExampleContext], T]) -> tuple[T, float, dict[str, Any]]:
        """``(how(ctx), seconds, notes)``: what the method computes (``method.predict`` or
        ``method.answer_state``), the seconds it took (the method's own time: the shared
        capture is made before) and the notes it left for its record (:func:`take_recorded`)."""
        t0 = time.perf_counter()
        out = how(self.ctx)
        seconds = time.perf_counter() - t0
        return out, seconds, take_recorded(self.ctx.notes)

    def result(self, prediction: str, seconds: float, notes: dict[str, Any]) -> dict:
        """The pair's :func:`result_record`."""
        spec, prompt = self.method.spec, self.ctx.prompt_format
        return result_record(self.example, spec, prediction, seconds, notes, prompt)


def example_pairs(
    model,
    tokenizer,
    examples: Iterable[Example],
    methods: Sequence[Method],
    max_new_tokens: int,
    prompt: str,
    done: dict[tuple[str, str], dict],
) -> Iterator[list[Pair]]:
    """Per example, in order, the list of its pairs (:class:`Pair`, in the order of
    ``methods``): what every engine answers.

    A method that needs documents is left out on an example without any; a pair found in
    ``done`` (keyed by ``(id, method spec)``) carries that record. When some pair is left to
    answer with a method that answers from the captured documents (``uses_capture``), the
    capture is made before the list is yielded, so that it counts in no method's seconds.
    """
    for example in examples:
        ctx = ExampleContext(model, tokenizer, example, max_new_tokens, prompt)
        pairs = [
            Pair(example, method, ctx, done.get((example.id, method.spec)))
            for method in methods
            if example.documents or not method.needs_documents
        ]
        if example.documents and any(p.record is None and p.method.uses_capture for p in pairs):
            ctx.state  # noqa: B018 -- the shared capture, outside every method's "seconds"
        yield pairs


def run_on_transformers(
    model,
    tokenizer,
    examples: Sequence[Example],
    methods: Sequence[Method],
    max_new_tokens: int,
    prompt: str,
    done: dict[tuple[str, str], dict],
    on_record: Callable[[dict], None] | None = None,
    progress: bool = True,
) -> list[dict]:
    """:func:`kvedit.evals.litm.run` with kvedit's own decoding: each method answers
    (:meth:`Method.predict <kvedit.evals.methods.Method.predict>`) as its pair comes."""
    from tqdm.auto import tqdm

    records: list[dict] = []
    bar = tqdm(total=len(examples), desc="litm", disable=not progress, unit="ex")
    try:
        for pairs in example_pairs(
            model, tokenizer, examples, methods, max_new_tokens, prompt, done
        ):
            for pair in pairs:
                if pair.record is not None:  # taken from an earlier run
                    records.append(pair.record)
                    continue
                record = pair.result(*pair.answer(pair.method.predict))
                records.append(record)
                if on_record is not None:
                    on_record(record)
            bar.update(1)
    finally:
        bar.close()
    return records


def run_on_vllm(
    model,
    tokenizer,
    examples: Sequence[Example],
    methods: Sequence[Method],
    max_new_tokens: int,
    prompt: str,
    done: dict[tuple[str, str], dict],
    on_record: Callable[[dict], None] | None = None,
    progress: bool = True,
    batch: int = VLLM_BATCH,
    answerer: VLLMAnswerer | None = None,
    approximate: bool = False,
    **llm_kwargs: Any,
) -> tuple[list[dict], dict[str, float]]:
    """:func:`kvedit.evals.litm.run` with vLLM decoding (see the module doc): each method
    builds the state it answers from (:meth:`Method.answer_state
    <kvedit.evals.methods.Method.answer_state>`), and vLLM answers ``batch`` examples' pairs
    in one call.

    Returns the records (in the order the transformers engine makes them) and timings:
    ``engine_start_seconds`` (0 when ``answerer``, a
    :class:`~kvedit.integrations.vllm.answer.VLLMAnswerer`, is given) and ``serve_seconds``
    (publishing and vLLM's ``generate`` calls, summed). ``approximate``: serve states vLLM
    realises only approximately, labelled (an ``answerer`` given keeps its own setting).
    ``llm_kwargs`` go to the engine.

    Raises:
        InvalidInputError: a state vLLM realises only approximately (without ``approximate``)
            or not at all; it names the method and the flag.
    """
    from tqdm.auto import tqdm

    from kvedit.integrations.vllm.answer import VLLMAnswerer

    check_engine("vllm", methods, batch)
    own = answerer is None
    if own:
        from kvedit.integrations.vllm import on_cpu

        if on_cpu() and "gpu_memory_utilization" not in llm_kwargs:
            llm_kwargs.setdefault("kv_cache_memory_bytes", VLLM_KV_CACHE_BYTES)
        answerer = VLLMAnswerer(model, tokenizer, approximate=approximate, **llm_kwargs)
    records: list[dict] = []
    timings = {"engine_start_seconds": answerer.start_seconds if own else 0.0}
    serve_seconds = 0.0
    bar = tqdm(total=len(examples), desc="litm/vllm", disable=not progress, unit="ex")
    groups = example_pairs(model, tokenizer, examples, methods, max_new_tokens, prompt, done)
    try:
        while chunk := list(islice(groups, batch)):
            pairs = [pair for group in chunk for pair in group]
            asked: list[tuple[float, dict[str, Any]]] = []  # the submitted pairs' own work
            for pair in pairs:
                if pair.record is None:
                    state, seconds, notes = pair.answer(pair.method.answer_state)
                    try:
                        answerer.submit(state, pair.ctx.continuation, max_new_tokens)
                    except InvalidInputError as e:
                        raise InvalidInputError(
                            f"--engine vllm, method {pair.method.spec}, example "
                            f"{pair.example.id}: {e}"
                        ) from e
                    asked.append((seconds, notes))
            served_list = answerer.flush()
            if len(served_list) != len(asked):  # never pair an answer with another example
                raise KVEditError(
                    f"the engine returned {len(served_list)} answers for {len(asked)} prompts"
                )
            answers = iter(zip(asked, served_list, strict=True))
            for pair in pairs:
                if pair.record is not None:  # taken from an earlier run
                    records.append(pair.record)
                    continue
                (seconds, notes), served = next(answers)
                serve_seconds += served.seconds
                record = pair.result(served.text, seconds + served.seconds, notes)
                record["exact"] = served.exact
                if served.approximation is not None:
                    record["approximation"] = served.approximation
                records.append(record)
                if on_record is not None:
                    on_record(record)
            bar.update(len(chunk))
    finally:
        bar.close()
        if own:
            answerer.close()
    timings["serve_seconds"] = round(serve_seconds, 3)
    return records, timings
