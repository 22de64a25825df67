"""Which engine decodes the answers of ``kvedit eval litm``: kvedit's own, or vLLM.

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
the published cache realises the method's edit exactly (an ``emphasize`` strength that is not
``log(r + 1)`` is realised by the nearest copy count).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvedit.errors import InvalidInputError, KVEditError
from kvedit.evals.methods import ExampleContext, Method
from kvedit.evals.prompts import plain_answer
from kvedit.evals.schema import Example, score

if TYPE_CHECKING:
    from kvedit.integrations.vllm.answer import VLLMAnswerer

__all__ = [
    "ENGINES",
    "VLLM_BATCH",
    "VLLM_KV_CACHE_BYTES",
    "check_engine",
    "RECORDED_NOTES",
    "result_record",
    "run_on_vllm",
    "take_recorded",
]

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


RECORDED_NOTES = ("auto_choice", "cache_bytes")
"""What a method leaves in ``ctx.notes`` that goes into its record (``chosen``, ``bytes``)."""


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
        "method": spec,
        "gold_index": example.gold_index,
        "prediction": prediction,
        "correct": bool(score(example, prediction)),
        "seconds": round(seconds, 3),
    }
    chosen = notes.get("auto_choice")  # the documents auto/reread chose
    if chosen is not None:
        record["chosen"] = [int(i) for i in chosen]
    cache_bytes = notes.get("cache_bytes")  # a compression method's bytes
    if cache_bytes is not None:
        record["bytes"] = round(float(cache_bytes), 4)
    return record


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
    **llm_kwargs: Any,
) -> tuple[list[dict], dict[str, float]]:
    """:func:`kvedit.evals.litm.run` with vLLM decoding (see the module doc).

    Returns the records (in the order the transformers engine makes them) and timings:
    ``engine_start_seconds`` (0 when ``answerer``, a
    :class:`~kvedit.integrations.vllm.answer.VLLMAnswerer`, is given) and ``serve_seconds``
    (publishing and vLLM's ``generate`` calls, summed). ``llm_kwargs`` go to the engine.
    """
    from tqdm.auto import tqdm

    from kvedit.integrations.vllm.answer import VLLMAnswerer

    check_engine("vllm", methods, batch)
    own = answerer is None
    if own:
        from kvedit.integrations.vllm import on_cpu

        if on_cpu() and "gpu_memory_utilization" not in llm_kwargs:
            llm_kwargs.setdefault("kv_cache_memory_bytes", VLLM_KV_CACHE_BYTES)
        answerer = VLLMAnswerer(model, tokenizer, **llm_kwargs)
    records: list[dict] = []
    timings = {"engine_start_seconds": answerer.start_seconds if own else 0.0}
    serve_seconds = 0.0
    bar = tqdm(total=len(examples), desc="litm/vllm", disable=not progress, unit="ex")
    try:
        for lo in range(0, len(examples), batch):
            slots: list[dict | tuple[Example, str, float, dict]] = []
            for example in examples[lo : lo + batch]:
                ctx = ExampleContext(model, tokenizer, example, max_new_tokens, prompt)
                for method in methods:
                    if method.needs_documents and not example.documents:
                        continue
                    if (example.id, method.spec) in done:
                        slots.append(done[(example.id, method.spec)])
                        continue
                    if example.documents:
                        ctx.state  # noqa: B018 -- the shared capture, outside "seconds"
                    t0 = time.perf_counter()
                    state = method.answer_state(ctx)
                    seconds = time.perf_counter() - t0
                    notes = take_recorded(ctx.notes)
                    answerer.submit(state, ctx.continuation, max_new_tokens)
                    slots.append((example, method.spec, seconds, notes))
            served_list = answerer.flush()
            expected = sum(not isinstance(slot, dict) for slot in slots)
            if len(served_list) != expected:  # never pair an answer with another example
                raise KVEditError(
                    f"the engine returned {len(served_list)} answers for {expected} prompts"
                )
            answers = iter(served_list)
            for slot in slots:
                if isinstance(slot, dict):  # taken from an earlier run
                    records.append(slot)
                    continue
                example, spec, seconds, notes = slot
                served = next(answers)
                serve_seconds += served.seconds
                record = result_record(
                    example, spec, served.text, seconds + served.seconds, notes, prompt
                )
                record["exact"] = served.exact
                records.append(record)
                if on_record is not None:
                    on_record(record)
            bar.update(len(examples[lo : lo + batch]))
    finally:
        bar.close()
        if own:
            answerer.close()
    timings["serve_seconds"] = round(serve_seconds, 3)
    return records, timings
