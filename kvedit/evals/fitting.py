"""Fitting the learned scorer (:class:`kvedit.compress.Learned`) for a model: ``kvedit memory
fit-scorer``.

The scorer predicts the :class:`~kvedit.compress.KVzip` score of each cache entry from the
entry's own key (rotation undone) and value (:func:`~kvedit.compress.scorers.learned.entry_features`).
A fit runs the model over transcripts kvedit makes itself, with no data from outside the
package: :func:`fitting_conversations` takes the memory suite's ``facts`` conversations (a chat
stating facts among small talk) and ``nq-shared`` conversations (NQ passages as tool messages)
of the *tuning* seeds (:data:`FIT_SEEDS`, never the report seeds the evaluation uses). Each
transcript is held by a :class:`kvedit.Memory` with no budget (an exact capture), scored once by
``KVzip`` (chunks of 2,048 tokens, as kvpress), and every entry of every global layer but the
first :data:`~kvedit.compress.scorers.kvzip.SINKS` becomes a sample: features ``x``, target
``log(score)`` per KV head. Per layer a ridge regression (features standardized, an intercept,
the penalty chosen among :data:`PENALTIES` on the held-out transcripts) gives the map; its
held-out R² (per layer and mean) is recorded in the fit's metadata.

On CPU a fit of SmolLM2-135M over the default transcripts takes a few minutes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvedit import checks
from kvedit.compress.scorers.kvzip import SINKS, KVzip
from kvedit.compress.scorers.learned import Fitted, entry_features
from kvedit.errors import InvalidInputError

__all__ = [
    "FIT_SEEDS",
    "PENALTIES",
    "Samples",
    "check_size",
    "collect",
    "fit",
    "fitting_conversations",
]

FIT_SEEDS = (0, 3)
"""The seeds of the transcripts a fit reads: tuning seeds of the memory suite (its reports use
seeds 1 and 2)."""

PENALTIES = (0.1, 1.0, 10.0, 100.0, 1000.0)
"""Ridge penalties tried (on standardized features); the one with the best held-out R² is kept."""

REREAD_ROOM = 256
"""Positions a transcript must leave free for KVzip's re-read (its chunks shrink to fit)."""

FLOOR = 1e-6
"""The smallest score whose log is a target (a score of 0: an entry no re-read query reads)."""


@dataclass(frozen=True)
class Samples:
    """Per global layer, features ``x`` ``[N, F]`` and targets ``y`` ``[N, kv_heads]`` (log
    scores), and which transcript each sample came from (``source`` ``[N]``)."""

    x: dict[int, torch.Tensor]
    y: dict[int, torch.Tensor]
    source: dict[int, torch.Tensor]


def check_size(size: object, name: str = "size") -> int:
    """``size`` if it is a facts transcript's message count (even, in
    [:data:`~kvedit.evals.tasks.memory_facts.MIN_MESSAGES`,
    :data:`~kvedit.evals.tasks.memory_facts.MAX_MESSAGES`]); refused naming ``name`` (the
    caller's own, such as ``--size``) and the limits before any model loads.

    Raises:
        InvalidInputError: not an int, odd, or outside the limits.
    """
    from kvedit.evals.tasks.memory_facts import MAX_MESSAGES, MIN_MESSAGES

    if (
        not isinstance(size, int)
        or isinstance(size, bool)
        or size % 2
        or not MIN_MESSAGES <= size <= MAX_MESSAGES
    ):
        raise InvalidInputError(
            f"{name} must be an even number of messages in [{MIN_MESSAGES}, {MAX_MESSAGES}], "
            f"not {size!r}"
        )
    return size


def fitting_conversations(
    n_facts: int = 3, n_nq: int = 2, seeds: Sequence[int] = FIT_SEEDS, size: int = 90
):
    """The transcripts a fit reads: per seed, ``n_facts`` facts conversations (``size``
    messages) and ``n_nq`` nq-shared conversations (12 documents)."""
    from kvedit.evals.memory_specs import build_conversations

    out = []
    for seed in seeds:
        if n_facts:
            out += build_conversations("facts", n_facts, seed, size, 9)
        if n_nq:
            out += build_conversations("nq-shared", n_nq, seed, 12, 6)
    return out


def collect(
    model, tokenizer, conversations, progress: Callable[[str], None] | None = None
) -> Samples:
    """The samples of ``conversations`` (module docstring)."""
    from kvedit.memory.conversation import Memory
    from kvedit.memory.rendering import Message

    xs: dict[int, list] = {}
    ys: dict[int, list] = {}
    src: dict[int, list] = {}
    limit = checks.positions_limit(model, None)
    for k, conv in enumerate(conversations):
        t0 = time.perf_counter()
        memory = Memory(model, tokenizer)
        rendered = memory.renderer.render([Message(r, c) for r, c in conv.messages])
        if limit is not None and len(rendered.ids) + REREAD_ROOM > limit:
            if progress is not None:
                progress(
                    f"{conv.id}: {len(rendered.ids)} tokens, past the model's positions: left out"
                )
            continue
        for role, content in conv.messages:
            memory.add(role, content)
        state = memory.state
        layers = list(state.global_layers)
        scores = KVzip().score(state, layers)
        for i in layers:
            keep = (state.layers[i].token_index >= SINKS).nonzero().flatten()
            x = entry_features(state, i, keep)
            y = scores[i][0][:, keep.cpu()].T.clamp_min(FLOOR).log()
            xs.setdefault(i, []).append(x.cpu())
            ys.setdefault(i, []).append(y.cpu())
            src.setdefault(i, []).append(torch.full((len(keep),), k))
        if progress is not None:
            progress(f"{conv.id}: {len(state)} tokens, {time.perf_counter() - t0:.0f} s")
    return Samples(
        {i: torch.cat(v) for i, v in xs.items()},
        {i: torch.cat(v) for i, v in ys.items()},
        {i: torch.cat(v) for i, v in src.items()},
    )


def _ridge(x: torch.Tensor, y: torch.Tensor, penalty: float):
    """``(mean, scale, weight, bias)`` of a ridge map ``y ~ ((x - mean) / scale) @ weight +
    bias``, in float64."""
    x, y = x.double(), y.double()
    mean = x.mean(0)
    scale = x.std(0).clamp_min(1e-6)
    z = (x - mean) / scale
    bias = y.mean(0)
    a = z.T @ z + penalty * len(z) / 1000 * torch.eye(z.shape[1], dtype=z.dtype)
    weight = torch.linalg.solve(a, z.T @ (y - bias))
    return mean, scale, weight, bias


def _r2(pred: torch.Tensor, y: torch.Tensor) -> float:
    """The coefficient of determination, averaged over the target's columns."""
    y, pred = y.double(), pred.double()
    total = ((y - y.mean(0)) ** 2).sum(0).clamp_min(1e-12)
    return float((1 - ((pred - y) ** 2).sum(0) / total).mean())


def fit(samples: Samples, held_out: Sequence[int], meta: dict | None = None) -> Fitted:
    """Per layer the ridge map of the samples not from the transcripts ``held_out`` (their
    indices), the penalty chosen by R² on the held-out ones, then refit on all samples;
    ``meta`` is recorded with the penalties and the held-out R² (per layer and mean).

    Raises:
        InvalidInputError: no held-out transcript, or none left to fit on.
    """
    if not samples.x:
        raise InvalidInputError("no transcript fits the model's positions: nothing to fit on")
    if not held_out:
        raise InvalidInputError("a fit needs at least one held-out transcript")
    layers, record = {}, {}
    for i in sorted(samples.x):
        x, y = samples.x[i], samples.y[i]
        test = torch.isin(samples.source[i], torch.tensor(list(held_out)))
        if bool(test.all()) or not bool(test.any()):
            raise InvalidInputError("the held-out transcripts must be some, not all, of them")
        best = None
        for penalty in PENALTIES:
            mean, scale, weight, bias = _ridge(x[~test], y[~test], penalty)
            r2 = _r2(((x[test].double() - mean) / scale) @ weight + bias, y[test])
            if best is None or r2 > best[1]:
                best = (penalty, r2)
        penalty, r2 = best
        mean, scale, weight, bias = _ridge(x, y, penalty)
        layers[i] = (mean.float(), scale.float(), weight.float(), bias.float())
        record[str(i)] = {"penalty": penalty, "r2": round(r2, 4)}
    mean_r2 = sum(v["r2"] for v in record.values()) / max(len(record), 1)
    meta = dict(meta or {})
    meta["fit"] = {**meta.get("fit", {}), "layers": record, "held_out_r2": round(mean_r2, 4)}
    return Fitted(layers, meta)


def fit_scorer(
    model,
    tokenizer,
    *,
    model_name: str,
    n_facts: int = 3,
    n_nq: int = 2,
    seeds: Sequence[int] = FIT_SEEDS,
    size: int = 90,
    progress: Callable[[str], None] | None = None,
) -> Fitted:
    """A fit of the learned scorer for ``model`` (module docstring): the transcripts of
    :func:`fitting_conversations`, the last one of each kind held out for the penalty and the
    recorded R²."""
    from kvedit.fingerprint import model_fingerprint
    from kvedit.version import __version__

    n_facts = checks.count("n_facts", n_facts)
    n_nq = checks.count("n_nq", n_nq)
    if n_facts:
        check_size(size)
    conversations = fitting_conversations(n_facts, n_nq, seeds, size)
    if len(conversations) < 2:
        raise InvalidInputError("a fit needs at least two transcripts (one is held out)")
    t0 = time.perf_counter()
    samples = collect(model, tokenizer, conversations, progress)
    kinds: dict[str, int] = {}
    present = sorted({int(k) for k in next(iter(samples.source.values()), torch.zeros(0)).tolist()})
    for k in present:  # the last transcript of each kind (of those that fit the positions)
        kinds[conversations[k].id.split("-")[0]] = k
    held_out = sorted(set(kinds.values()))
    meta = {
        "model": model_fingerprint(model),
        "model_name": model_name,
        "target": "log kvzip score (chunk 2048), per KV head",
        "features": "key (rotation undone) and value of every KV head",
        "fit": {
            "transcripts": [conversations[k].id for k in present],
            "held_out": [conversations[k].id for k in held_out],
            "samples_per_layer": int(next(iter(samples.x.values()), torch.zeros(0)).shape[0]),
            "seconds": math.ceil(time.perf_counter() - t0),
            "kvedit": __version__,
        },
    }
    return fit(samples, held_out, meta)
