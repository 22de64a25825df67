"""Why a memory forgets what it should keep: the same conversations compressed once after the
last message, with several scores and several ways to share the budget, against the memory's
rounds (issue "Forgetting that holds at a tenth", §1).

For each ``facts`` conversation (as ``kvedit eval memory`` builds it for the same ``--seed``,
``--size``, ``--questions``, ``--n-examples``), a :class:`kvedit.Memory` with no budget holds
every message (an exact capture of the transcript, ``n`` tokens). Then, for each budget ``b``,
the context is cut to ``round(b * n)`` entries per global layer on average (the budget counted
as kvpress counts it: what the context holds when the question is asked; the question and the
answer come on top), keeping always the first :data:`SINKS` tokens, the system message and the
last token. Each question is answered over the cut context alone (``remember=False``), greedy,
``--max-new-tokens``.

Scores (``--scores``), each ``[kv_heads, n]`` per global layer, higher kept first:

* ``reconstruct``: kvedit's ``Reconstruct`` scorer (the memory's policy today) run once on the
  whole transcript: the largest attention an entry gets while the model re-reads the text after
  a repeat prompt, normalized over the whole cache.
* ``kvzip``: KVzip's scoring as kvpress runs it (:class:`kvedit.compress.KVzip`): the text
  re-read in chunks of 2,048 tokens after the repeat prompt, an entry's score its largest attention from
  its chunk's re-read, normalized over the sinks, the chunk and the re-read itself (not the
  whole cache).
* ``arrival``: the same chunk-local scores with each *message* as its chunk, computed when the
  message arrives (over the memory as it then is), never recomputed: what a memory can keep.
* ``learned``: ``kvzip``'s scores predicted from each entry's own key and value
  (:class:`kvedit.compress.Learned`, the fit ``--fit`` or the one shipped for the model): the
  same whether computed when an entry arrives or at the end.
* ``oracle``: the upper bound no query-agnostic score can beat: the attention the
  conversation's actual questions (each rendered after the transcript, as asked) give an entry,
  summed over a question's tokens, the largest over the questions (each query normalized over
  the whole cache). It reads the questions, never the gold answers.
* ``random``: scores drawn at random (seeded by the conversation), and ``recency``: an entry's
  score its position (the newest kept first): the two baselines.

Protected structure (``--protect``, each a variant of its own, suffixed ``+name``; the sinks,
the system message and the last token are always kept): ``template`` keeps every token outside
the messages' contents (turn markers and roles); ``firsts`` each message's first
:data:`FIRSTS` tokens.

The budget counted two ways (``--counts``): ``global`` (above: ``round(b * n)`` entries per
global layer) and ``own`` (suffix ``@own``): ``b`` of the entries the model's own cache holds
for the transcript, every layer with its window (Gemma-3: 3 global layers of ``n`` and 15
sliding layers of at most 512), the sliding layers kept whole and the global layers given what
is left (at least the protected tokens). On a model without sliding layers the two are equal.

Allocations (``--allocations``), each keeping ``round(b * n) * layers`` entries in all:

* ``layer``: every global layer keeps the same count, the same tokens on every KV head (an
  entry's score its largest over the heads);
* ``layers``: the count shared among the global layers (one ranking of (layer, token)), the
  same tokens on every KV head: the memory's ``reconstruct`` today (``+words``: an entry's score
  the largest of its word's, as today);
* ``heads``: one ranking of (layer, KV head, token): a head keeps what it needs (KVzip's and
  kvpress's ``KVzipPress`` default). Realized here as a per-head mask (accuracy only).
* ``tokens``: the same tokens on every layer and head (an entry's score its largest over
  them), as a served memory keeps (``keep="token"``).

The memory's rounds as they are (the fourth row of the diagnosis) are ``kvedit eval memory
--methods reconstruct`` on the same conversations.

Usage: ``python -m benchmarks.forget_diagnosis --seed 1 --n-examples 6 --out
runs/forget-diagnosis/smollm2-s1.jsonl``; ``--summarize FILE ...`` prints the table.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks.common import add_model, markdown_table, parser, read_partial
from kvedit.compress.masking import masked_union
from kvedit.compress.scorers import KVzip, Learned, make_scorer
from kvedit.evals.memory_specs import build_conversations
from kvedit.evals.metrics import best_subspan_em
from kvedit.spans import word_index
from kvedit.states.passes import recompute_last
from kvedit.states.state import KVState

SINKS = 4
"""Leading tokens always kept (attention sinks, as kvpress's ``n_sink``)."""
SCORES = ("reconstruct", "kvzip", "arrival", "learned", "oracle", "random", "recency")
FIRSTS = 4
"""Each message's leading tokens kept by ``--protect firsts``."""
PROTECTS = ("none", "template", "firsts")
COUNTS = ("global", "own")
ALLOCATIONS = ("layer", "layers", "layers+words", "heads", "tokens")


def allocate(
    scores: dict[int, torch.Tensor], protected: torch.Tensor, per_layer: int, how: str
) -> dict[int, torch.Tensor]:
    """``{layer: [kv_heads, n] bool}``: what each head keeps, ``per_layer`` entries per layer
    on average (module docstring's allocations; ``protected`` ``[n]`` always kept)."""
    layers = list(scores)
    heads, n = scores[layers[0]].shape
    inf = float("inf")
    if how == "heads":
        flat = torch.cat([scores[i].masked_fill(protected, inf).flatten() for i in layers])
        kept = _top(flat, per_layer * len(layers) * heads)
        return {
            i: kept[j * n * heads : (j + 1) * n * heads].reshape(heads, n)
            for j, i in enumerate(layers)
        }
    rows = {i: scores[i].amax(dim=0).masked_fill(protected, inf) for i in layers}
    if how == "tokens":  # one choice of tokens for every layer and head (served memories')
        best = torch.stack([rows[i] for i in layers]).amax(dim=0)
        return {i: _top(best, per_layer)[None].expand(heads, n) for i in layers}
    if how == "layer":
        return {i: _top(rows[i], per_layer)[None].expand(heads, n) for i in layers}
    kept = _top(torch.cat([rows[i] for i in layers]), per_layer * len(layers))
    return {i: kept[j * n : (j + 1) * n][None].expand(heads, n) for j, i in enumerate(layers)}


def _top(flat: torch.Tensor, k: int) -> torch.Tensor:
    kept = torch.zeros(len(flat), dtype=torch.bool)
    kept[flat.topk(min(k, len(flat))).indices] = True
    return kept


def word_max(scores: dict[int, torch.Tensor], state: KVState) -> dict[int, torch.Tensor]:
    """Each entry's score the largest of its word's entries (the memory's rule today)."""
    words = word_index(state.text, state.offsets)
    w = torch.unique(words, return_inverse=True)[1]
    out = {}
    for i, s in scores.items():
        best = torch.full((s.shape[0], int(w.max()) + 1), float("-inf"))
        best = best.scatter_reduce(1, w[None].expand_as(s), s, "amax")
        out[i] = best[:, w]
    return out


def cut(state: KVState, kept: dict[int, torch.Tensor]) -> KVState:
    """``state`` with each global layer's heads masked to ``kept`` (a per-head selection)."""
    layers = list(state.layers)
    for i, k in kept.items():
        layers[i] = masked_union(layers[i], k[None].contiguous())
    return recompute_last(state.replace(layers=layers))


def oracle_scores(memory, conv, state: KVState) -> dict[int, torch.Tensor]:
    """``{layer: [kv_heads, n]}``: the attention each of the conversation's questions (rendered
    after the transcript, as asked) gives each entry of the global layers, summed over the
    question's tokens, the largest over the questions."""
    from kvedit.compress.observe import to_kv_heads
    from kvedit.memory.rendering import Message
    from kvedit.states.observer import observed_attention

    model, _ = state.require_model()
    n = len(state)
    out: dict[int, torch.Tensor] = {}
    for probe in conv.probes:
        asked = [*memory.messages, Message("user", probe.question)]
        ids = memory.renderer.render(asked, generation_prompt=True).ids[n:]
        positions = torch.arange(state.next_position, state.next_position + len(ids))
        probs = observed_attention(model, state.layers, ids, positions, reduce="sum")
        for i in state.global_layers:
            heads = state.layers[i].kv_shape[1]
            got = to_kv_heads(probs[i][..., : len(state.layers[i])], heads, "max")[0].float()
            out[i] = got if i not in out else torch.maximum(out[i], got)
    return out


def baseline_scores(name: str, state: KVState, seed: int) -> dict[int, torch.Tensor]:
    """``random`` (seeded) or ``recency`` (an entry's index: the newest first) scores."""
    out = {}
    g = torch.Generator().manual_seed(seed)
    for i in state.global_layers:
        heads, n = state.layers[i].kv_shape[1], len(state.layers[i])
        if name == "random":
            out[i] = torch.rand(heads, n, generator=g)
        else:
            out[i] = torch.arange(n, dtype=torch.float32)[None].expand(heads, n).clone()
    return out


def structure(memory, how: str, n: int) -> torch.Tensor:
    """``[n]`` bool: the tokens ``--protect how`` keeps (module docstring)."""
    keep = torch.zeros(n, dtype=torch.bool)
    if how == "firsts":
        for t in memory.turns:
            keep[t.start : min(t.end, t.start + FIRSTS)] = True
    elif how == "template":
        r = memory.renderer.render(list(memory.messages))
        inside = torch.zeros(n, dtype=torch.bool)
        starts, ends = r.offsets[:n, 0], r.offsets[:n, 1]
        for c in r.contents:
            if c is not None:
                inside |= (starts >= c[0]) & (ends <= c[1]) & (ends > starts)
        keep = ~inside
    return keep


def own_per_layer(state: KVState, budget: float, floor: int) -> int:
    """Entries per global layer when ``budget`` counts the model's own windowed cache, the
    sliding layers kept whole (at least ``floor``)."""
    n = len(state)
    windows = [getattr(layer, "window", None) for layer in state.layers]
    own = sum(min(n, w) if w else n for w in windows)
    sliding = sum(min(n, w) for w in windows if w)
    return max(round((budget * own - sliding) / len(state.global_layers)), floor)


def make_scores(memory, conv, state, names, arrival, fit) -> tuple[dict, dict]:
    """Each score of ``names`` per global layer, and the seconds each took."""
    made: dict[str, dict[int, torch.Tensor]] = {}
    seconds: dict[str, float] = {}
    for name in names:
        t0 = time.perf_counter()
        if name == "arrival":
            made[name] = arrival
        elif name == "oracle":
            made[name] = oracle_scores(memory, conv, state)
        elif name in ("random", "recency"):
            made[name] = baseline_scores(name, state, sum(map(ord, conv.id)))
        else:
            scorer = Learned(path=fit) if name == "learned" else make_scorer(name)
            got = scorer.score(state, list(state.global_layers))
            made[name] = {i: s[0].float() for i, s in got.items()}
        seconds[name] = time.perf_counter() - t0
    return made, seconds


def arrival_scores(memory, conv) -> tuple[dict[int, torch.Tensor], float]:
    """The memory of ``conv`` (messages added one by one) and KVzip's scores of each message
    made when it arrives; the seconds those took."""
    arrival: dict[int, torch.Tensor] = {}
    t_arrival = 0.0
    for role, content in conv.messages:
        turn = memory.add(role, content)
        t0 = time.perf_counter()
        state = memory.state
        got = KVzip().score_tokens(state, turn.start, turn.end, list(state.global_layers))
        for i, s in got.items():
            full = torch.zeros(s.shape[1], len(state))
            old = arrival.get(i)
            if old is not None:
                full[:, : old.shape[1]] = old
            full[:, turn.start : turn.end] = s[0].float().cpu()
            arrival[i] = full
        t_arrival += time.perf_counter() - t0
    return arrival, t_arrival


def run_conversation(
    model,
    tok,
    conv,
    budgets,
    scores,
    allocations,
    max_new_tokens,
    fit=None,
    protects=("none",),
    counts=("global",),
) -> list[dict]:
    """Records (one per question, score, allocation, protection, count and budget) of one
    conversation."""
    from kvedit.memory.answering import decode
    from kvedit.memory.conversation import Memory
    from kvedit.memory.rendering import Message
    from kvedit.states.capturing import extend_ids

    memory = Memory(model, tok)
    if "arrival" in scores:
        arrival, t_arrival = arrival_scores(memory, conv)
    else:
        for role, content in conv.messages:
            memory.add(role, content)
        arrival, t_arrival = {}, 0.0
    state = memory.state
    n = len(state)
    made, seconds = make_scores(memory, conv, state, scores, arrival, fit)
    seconds["arrival"] = t_arrival
    base = torch.zeros(n, dtype=torch.bool)
    base[:SINKS] = True
    base[-1] = True
    for t in memory.turns:
        if t.role == "system":
            base[t.start : t.end] = True

    def answers(cut_state: KVState) -> list[tuple[str, bool]]:
        out = []
        for probe in conv.probes:
            asked = [*memory.messages, Message("user", probe.question)]
            p = memory.renderer.render(asked, generation_prompt=True)
            prompt = extend_ids(cut_state, p.ids[n:], p.offsets[n:], p.text)
            text = decode(prompt, max_new_tokens, memory.renderer.stops).text.strip()
            out.append((text, best_subspan_em(text, probe.answers)))
        return out

    records = []

    def add(variant: str, budget: float, got: list, kept: int) -> None:
        for k, (probe, (text, ok)) in enumerate(zip(conv.probes, got, strict=True)):
            records.append(
                {
                    "id": f"{conv.id}-q{k}",
                    "example": conv.id,
                    "method": variant,
                    "variant": variant,
                    "budget": budget,
                    "bucket": probe.bucket,
                    "question": probe.question,
                    "prediction": text,
                    "correct": ok,
                    "tokens": n,
                    "kept_per_layer": kept,
                    "score_seconds": round(seconds.get(variant.split("/")[0], 0.0), 3),
                }
            )

    add("reuse", 1.0, answers(state), n)
    for budget, protect, count in itertools.product(budgets, protects, counts):
        protected = base | structure(memory, protect, n)
        floor = int(protected.sum())
        if count == "own":
            per_layer = own_per_layer(state, budget, floor)
        else:
            per_layer = max(round(budget * n), floor)
        suffix = ("" if protect == "none" else f"+{protect}") + (
            "" if count == "global" else "@own"
        )
        for name in scores:
            for how in allocations:
                s = made[name]
                if how == "layers+words":
                    s, how_ = word_max(s, state), "layers"
                else:
                    how_ = how
                kept = allocate(s, protected, per_layer, how_)
                add(f"{name}/{how}{suffix}", budget, answers(cut(state, kept)), per_layer)
    return records


def summarize(records: Sequence[dict]) -> str:
    """A markdown table: mean accuracy per variant and budget, per bucket, and of reuse."""
    groups: dict[tuple[str, float], list[dict]] = {}
    for r in records:
        groups.setdefault((r["variant"], float(r["budget"])), []).append(r)
    reuse = groups.get(("reuse", 1.0), [])
    base = sum(r["correct"] for r in reuse) / max(len(reuse), 1)
    rows = []
    for (variant, budget), rs in sorted(groups.items(), key=lambda kv: (-kv[0][1], kv[0][0])):
        mean = sum(r["correct"] for r in rs) / len(rs)
        per = []
        for bucket in ("early", "middle", "late"):
            b = [r["correct"] for r in rs if r["bucket"] == bucket]
            per.append(f"{sum(b) / len(b):.3f}" if b else "-")
        ratio = f"{mean / base:.2f}" if base else "-"
        rows.append([variant, f"{budget:g}", *per, f"{mean:.3f}", ratio, str(len(rs))])
    head = ["scores/allocation", "budget", "early", "middle", "late", "mean", "of reuse", "n"]
    return "\n".join(markdown_table(head, rows))


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    add_model(p)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--n-examples", type=int, default=6)
    p.add_argument("--size", type=int, default=90)
    p.add_argument("--questions", type=int, default=9)
    p.add_argument("--budgets", default="0.25,0.1")
    p.add_argument("--scores", default=",".join(SCORES))
    p.add_argument("--allocations", default=",".join(ALLOCATIONS))
    p.add_argument("--protect", default="none", help=f"comma list of {PROTECTS}")
    p.add_argument("--counts", default="global", help=f"comma list of {COUNTS}")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--fit", default=None, help="the learned scorer's fit (default: shipped)")
    p.add_argument("--first", type=int, default=0, help="skip the first N conversations")
    p.add_argument("--out", type=Path, default=Path("runs/forget-diagnosis/records.jsonl"))
    p.add_argument("--summarize", type=Path, nargs="*", help="print the table of these files")
    args = p.parse_args(argv)
    if args.summarize:
        records = [r for path in args.summarize for r in read_partial(path)]
        print(summarize(records))
        return 0
    from kvedit.models import load_model

    scores = [s for s in args.scores.split(",") if s]
    allocations = [a for a in args.allocations.split(",") if a]
    protects = [x for x in args.protect.split(",") if x]
    counts = [x for x in args.counts.split(",") if x]
    bad = [s for s in scores if s not in SCORES] + [a for a in allocations if a not in ALLOCATIONS]
    bad += [x for x in protects if x not in PROTECTS] + [x for x in counts if x not in COUNTS]
    if bad:
        p.error(
            f"unknown --scores/--allocations/--protect/--counts {bad}: choose from {SCORES}, "
            f"{ALLOCATIONS}, {PROTECTS} and {COUNTS}"
        )
    budgets = [float(b) for b in args.budgets.split(",") if b]
    if args.threads:
        torch.set_num_threads(args.threads)
    conversations = build_conversations(
        "facts", args.n_examples, args.seed, args.size, args.questions
    )
    model, tok = load_model(args.model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    done = {r["example"] for r in read_partial(args.out)} if args.out.exists() else set()
    for conv in conversations[args.first :]:
        if conv.id in done:
            continue
        t0 = time.perf_counter()
        records = run_conversation(
            model,
            tok,
            conv,
            budgets,
            scores,
            allocations,
            args.max_new_tokens,
            args.fit,
            protects,
            counts,
        )
        for r in records:
            r["model"] = args.model
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        print(f"{conv.id}: {time.perf_counter() - t0:.0f} s", flush=True)
    print(summarize(read_partial(args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
