"""kvpress's ``KVzipPress`` and ``SnapKVPress`` on the conversations of ``kvedit eval memory``
(``--task nq-shared``, the default, or ``facts``), at the same budgets (the peer run of the
memory suite): the same token ids, compressed and answered by kvpress in its own venv, scored
with kvedit's metric.

Three sub-commands, each in its own interpreter:

* ``export`` (kvedit's venv): the ``--task``'s conversations, as ``kvedit eval memory`` builds
  them for the same ``--seed``, ``--size``, ``--questions`` and ``--n-examples``, to one JSON file:
  the messages, the probes (question, answers, bucket, gold position), each conversation's
  ``full_entries`` and its rendering by kvedit's own chat renderer
  (``kvedit.memory.rendering.renderer_for("chat", tokenizer)``): the text and ids of the
  messages (the context a ``kvedit.Memory`` holds when the first question comes) and, per
  question, the ids that follow them when it is asked (the user message and the opening of the
  answer); and ``model_dir``, the Hugging Face folder kvedit loads the model from (its
  converted copy of the bundled GGUF; null for a model built in memory).
* ``run`` (``.venv-kvpress``, made by ``make kvpress-setup``; never imports kvedit): loads the
  model from the export's ``model_dir`` (or ``--model-dir``; a folder, since ``KVzipPress``
  loads the tokenizer from ``model.config.name_or_path``; transformers 5.2 reads the folder
  kvedit's 5.24 writes), and per conversation, press and budget ``b`` prefills the context ids inside the press's
  context manager with ``compression_ratio = 1 - b`` (kvpress's ratio is the fraction of the
  context's KV pairs *removed*; kvedit's budget the fraction kept), then answers the questions
  one after another as ``KVPressTextGenerationPipeline._forward`` does: its
  ``generate_answer`` (greedy, ``--max-new-tokens``, positions counted from the uncompressed
  context length), then the question and answer cut from the cache, so each question is
  answered over the compressed context alone. ``--keep`` instead keeps each question and its
  answer (uncompressed, rendered by the chat template) before the next, as kvedit's
  ``remember=True``. ``--baseline`` adds kvpress with no press (budget 1). Writes one JSON line
  per question.
* ``score`` (kvedit's venv): scores the records with ``kvedit.evals.metrics.best_subspan_em``
  and prints ``kvedit.evals.memory_report.format_memory_table`` (a row per press and budget;
  ``rounds`` is 0: kvpress compresses once); ``--kvedit RUN ...`` adds ``kvedit eval memory``
  runs' rows on the same conversations (results folders, pooled as ``benchmarks.memory_table``
  pools them: a method a later run repeats on the same conversations replaces the earlier's).

Commands, from the repository root::

    make kvpress-setup
    .venv/bin/python -m benchmarks.kvpress_peer export --seed 1 --size 12 --questions 9 \\
        --n-examples 7 --out runs/kvpress-peer/conversations.json
    OMP_NUM_THREADS=1 nice -n 19 .venv-kvpress/bin/python -m benchmarks.kvpress_peer run \\
        --conversations runs/kvpress-peer/conversations.json --budgets 0.25,0.1 --baseline \\
        --out runs/kvpress-peer/records.jsonl
    .venv/bin/python -m benchmarks.kvpress_peer score runs/kvpress-peer/records.jsonl

The same ``run`` with ``--keep --out runs/kvpress-peer/records-kept.jsonl`` keeps each question
and answer. About 20 minutes for 7 conversations (5 passes each) on one loaded CPU thread;
``KVzipPress`` takes two thirds of it. Report: ``reports/memory/kvpress_peer.md``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

FORMAT = "kvedit-kvpress-peer/1"
"""The ``format`` of the exported conversations file."""
PRESSES = {
    "kvzip": "KVzipPress",
    "snapkv": "SnapKVPress",
    "kvzip-layerwise": "KVzipPress+layerwise",
    "kvzip-uniform": "KVzipPress+uniform-heads",
}
"""``--presses`` names and the presses they run (the records' ``press``): kvpress's classes, and
two variants of ``KVzipPress`` for the forgetting diagnosis: ``layerwise=True`` (every layer
removes the same fraction), and one choice for every KV head (an entry's score its largest over
the heads before the ranking, so a layer keeps the same tokens on every head)."""
NO_PRESS = "none"
"""The ``press`` of ``--baseline`` records: kvpress's protocol with no press, at budget 1."""
DEFAULT_OUT = Path("runs") / "kvpress-peer"
TASKS = ("nq-shared", "facts")
"""``export --task``: the ``kvedit eval memory`` tasks whose conversations kvpress answers."""
MODEL = "smollm2-135m-instruct"

# ------------------------------------------------------------------------- pure helpers


def parse_budgets(text: str) -> list[float]:
    """``--budgets``: comma-separated fractions in (0, 1) of the context's tokens kept."""
    out: list[float] = []
    for item in (s.strip() for s in str(text).split(",")):
        if not item:
            continue
        try:
            value = float(item)
        except ValueError:
            raise SystemExit(f"--budgets: {item!r} is not a number") from None
        if not math.isfinite(value) or not 0 < value < 1:
            raise SystemExit(f"--budgets: {item} is not in (0, 1) (the fraction of tokens kept)")
        if value not in out:
            out.append(value)
    if not out:
        raise SystemExit(f"--budgets {text!r}: give fractions such as 0.25,0.1")
    return out


def compression_ratio(budget: float) -> float:
    """kvpress's ``compression_ratio`` for kvedit's budget: kvpress removes that fraction of
    the context's KV pairs (per layer and head for ``SnapKVPress``; over all layers and heads
    together for ``KVzipPress``), kvedit keeps ``budget`` of the conversation's tokens."""
    if not 0 < budget <= 1:
        raise ValueError(f"budget {budget} is not in (0, 1]")
    return round(1.0 - budget, 12)


def press_label(press: str, keep: bool) -> str:
    """The ``method`` of a record in the table: ``kvpress-KVzipPress``, with ``+kept`` when
    each question and answer were kept (``--keep``)."""
    return f"kvpress-{press}" + ("+kept" if keep else "")


def group_key(record: dict) -> tuple[str, str, float, bool]:
    """What one pass over a conversation shares: ``(example, press, budget, keep)``."""
    return (record["example"], record["press"], float(record["budget"]), bool(record["keep"]))


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file; a cut last line (a killed run) is dropped."""
    if not path.exists():
        return []
    lines = path.read_text().split("\n")
    out = []
    for k, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if k == len(lines) - 1:  # no newline after it: cut while written
                print(f"note: dropped the cut last line of {path}", file=sys.stderr)
                continue
            raise SystemExit(f"{path}:{k + 1}: not JSON") from None
    return out


def complete_groups(records: Sequence[dict], sizes: dict[str, int]) -> list[dict]:
    """The records of the passes that finished (all ``sizes[example]`` questions), for
    ``--resume``; a pass is kept whole or not at all."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault(group_key(r), []).append(r)
    return [r for key, rs in groups.items() if len(rs) == sizes.get(key[0], -1) for r in rs]


def as_memory_records(records: Sequence[dict], correct: Any) -> list[dict]:
    """The records in the shape of ``kvedit eval memory``'s (for its summary and table):
    ``method`` the press label, ``correct`` from ``correct(prediction, answers)``, no
    forgetting rounds (kvpress compresses once), ``max_entries`` the tokens the budget keeps."""
    out = []
    for r in records:
        budget = float(r["budget"])
        out.append(
            {
                "id": r["id"],
                "example": r["example"],
                "method": press_label(r["press"], bool(r["keep"])),
                "budget": budget,
                "bucket": r["bucket"],
                "prediction": r["prediction"],
                "answers": r["answers"],
                "correct": float(correct(r["prediction"], r["answers"])),
                "seconds": r["seconds"],
                "rounds": 0,
                "forget_seconds": 0.0,
                "max_entries": None if budget >= 1 else round(budget * r["full_entries"]),
            }
        )
    return out


# ------------------------------------------------------------------------------- export


def export(args: argparse.Namespace) -> int:
    """Write the conversations file (module docstring); kvedit's venv."""
    from kvedit.atomic import atomic_write
    from kvedit.evals.memory_specs import build_conversations, full_entries
    from kvedit.memory.rendering import Message, renderer_for
    from kvedit.models import load_model

    conversations = build_conversations(
        args.task, args.n_examples, args.seed, args.size, args.questions
    )
    model, tokenizer = load_model(args.model, device="cpu")
    name = model.config.name_or_path  # the folder kvedit loads (none: built in memory)
    model_dir = (
        str(Path(name).resolve()) if name and (Path(name) / "config.json").exists() else None
    )
    del model
    prompt = "chat" if getattr(tokenizer, "chat_template", None) else "plain"  # the memory's
    renderer = renderer_for(prompt, tokenizer)
    items = []
    for conv in conversations:
        messages = [Message(role, content) for role, content in conv.messages]
        context = renderer.render(messages)
        n = len(context.ids)
        full = full_entries(renderer, conv)
        if full != n:  # the same rendering kvedit's budget counts
            raise SystemExit(f"{conv.id}: full_entries {full} != rendering {n}")
        probes = []
        for probe in conv.probes:
            asked = renderer.render([*messages, Message("user", probe.question)], True)
            if asked.ids[:n] != context.ids:
                raise SystemExit(f"{conv.id}: the question's rendering rewrites the context")
            probes.append(
                {
                    "question": probe.question,
                    "answers": list(probe.answers),
                    "bucket": probe.bucket,
                    "where": probe.where,
                    "question_text": asked.text[len(context.text) :],
                    "question_ids": asked.ids[n:],
                }
            )
        items.append(
            {
                "id": conv.id,
                "digest": conv.digest(),
                "remember": conv.remember,
                "messages": [list(m) for m in conv.messages],
                "full_entries": full,
                "context_text": context.text,
                "context_ids": context.ids,
                "probes": probes,
            }
        )
    payload = {
        "format": FORMAT,
        "task": args.task,
        "model": args.model,
        "model_dir": model_dir,
        "prompt": prompt,
        "stops": list(renderer.stops),
        "seed": args.seed,
        "size": args.size,
        "questions": args.questions,
        "n_examples": args.n_examples,
        "conversations": items,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, json.dumps(payload, ensure_ascii=False) + "\n")
    sizes = ", ".join(str(c["full_entries"]) for c in items)
    print(f"{out}: {len(items)} conversations of {sizes} tokens")
    return 0


# ---------------------------------------------------------------------------------- run


def load(folder: Path):
    """The converted model (float32, SDPA attention: ``KVzipPress`` refuses eager) and its
    tokenizer, on CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.eval(), tok


def kept_fraction(model, cache, context_length: int) -> float:
    """The fraction of the context's KV pairs the press left, over layers and KV heads:
    ``KVzipPress`` masks pairs (``masked_key_indices``, the cache keeps its length),
    ``SnapKVPress`` removes them."""
    layers = model.model.layers
    heads = model.config.num_key_value_heads
    total = len(layers) * heads * context_length
    kept = 0
    for i, layer in enumerate(layers):
        length = min(cache.get_seq_length(i), context_length)
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        kept += heads * length - (0 if masked is None else int(masked[0].numel()))
    return kept / total


def kept_per_layer(model, cache, context_length: int) -> list[float]:
    """Per layer, the context entries the press left per KV head, on average over the heads
    (what kvedit's records call ``entries_per_layer``)."""
    heads = model.config.num_key_value_heads
    out = []
    for i, layer in enumerate(model.model.layers):
        length = min(cache.get_seq_length(i), context_length)
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        gone = 0 if masked is None else int(masked[0].numel())
        out.append(round((heads * length - gone) / heads, 2))
    return out


def tail_ids(tokenizer, messages: list[dict], context_text: str, question: bool) -> list[int]:
    """The ids the chat template adds after ``context_text`` for ``messages`` (the context's
    messages and those asked since), with the generation prompt when ``question``."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=question)
    if not text.startswith(context_text):
        raise SystemExit("the chat template rewrites the context: --keep cannot append")
    return list(tokenizer(text[len(context_text) :], add_special_tokens=False)["input_ids"])


def make_press(kvpress, press_name: str, budget: float):
    """The press a record's ``press`` names (:data:`PRESSES`) at ``budget``."""
    name, _, variant = press_name.partition("+")
    ratio = compression_ratio(budget)
    if variant == "layerwise":
        return kvpress.KVzipPress(compression_ratio=ratio, layerwise=True)
    if variant == "uniform-heads":

        class UniformHeads(kvpress.KVzipPress):
            """KVzip's scores, each entry's the largest over its layer's KV heads."""

            def compress_post(self, model):
                best = self.score_val.amax(dim=2, keepdim=True)  # [layers, batch, 1, n]
                self.score_val = best.expand_as(self.score_val).contiguous()
                super().compress_post(model)

        return UniformHeads(compression_ratio=ratio)
    return getattr(kvpress, name)(compression_ratio=ratio)


def run_pass(
    pipe, conv: dict, press_name: str, budget: float, keep: bool, max_new_tokens: int
) -> list[dict]:
    """One press at one budget on one conversation: a record per question."""
    import kvpress
    import torch
    from transformers import DynamicCache

    model, tokenizer = pipe.model, pipe.tokenizer
    stops = conv.get("stops", [])
    ctx = torch.tensor([conv["context_ids"]])
    n = ctx.shape[1]
    for layer in model.model.layers:  # a previous KVzip pass's mask must not linger
        layer.self_attn.masked_key_indices = None
    cache = DynamicCache()
    press = None if press_name == NO_PRESS else make_press(kvpress, press_name, budget)
    t0 = time.perf_counter()
    with torch.inference_mode():
        if press is None:
            model.model(input_ids=ctx, past_key_values=cache)
        else:
            with press(model):
                model.model(input_ids=ctx, past_key_values=cache)
    compress_seconds = time.perf_counter() - t0
    kept = kept_fraction(model, cache, n)
    per_layer = kept_per_layer(model, cache, n)
    messages = [{"role": r, "content": c} for r, c in conv["messages"]]
    kept_ids: list[int] = []  # ids kept after the context (--keep), at positions n, n + 1...
    records = []
    for k, probe in enumerate(conv["probes"]):
        t = time.perf_counter()
        asked = [*messages, {"role": "user", "content": probe["question"]}]
        appended = len(kept_ids)
        if keep:
            ids = tail_ids(tokenizer, asked, conv["context_text"], True)
            if ids[:appended] != kept_ids:
                raise SystemExit(f"{conv['id']}: the chat template rewrites a kept answer")
            ids = ids[appended:]
            if k == 0 and ids != probe["question_ids"]:
                raise SystemExit(f"{conv['id']}: the question's ids differ from kvedit's")
        else:
            ids = probe["question_ids"]
        lengths = [cache.get_seq_length(i) for i in range(len(cache))]
        with torch.inference_mode():
            answer = pipe.generate_answer(
                question_ids=torch.tensor([ids]),
                cache=cache,
                context_length=n + appended,
                max_new_tokens=max_new_tokens,
            )
        pipe._remove_answer_from_cache(cache, lengths)  # kvpress's own step
        for stop in stops:  # the memory's own stops (the plain format's next label)
            answer = answer.split(stop)[0]
        text = answer.strip()
        if keep:  # the question and the answer as kvedit's memory keeps them
            messages = [*asked, {"role": "assistant", "content": text or " "}]
            full = tail_ids(tokenizer, messages, conv["context_text"], False)
            if full[:appended] != kept_ids:
                raise SystemExit(f"{conv['id']}: the chat template rewrites a kept answer")
            more = torch.tensor([full[appended:]])
            positions = torch.arange(n + appended, n + len(full)).unsqueeze(0)
            with torch.inference_mode():
                model.model(input_ids=more, past_key_values=cache, position_ids=positions)
            kept_ids = full
        records.append(
            {
                "id": f"{conv['id']}-q{k}",
                "example": conv["id"],
                "digest": conv["digest"],
                "press": press_name,
                "budget": budget,
                "compression_ratio": compression_ratio(budget),
                "keep": keep,
                "bucket": probe["bucket"],
                "where": probe["where"],
                "question": probe["question"],
                "answers": probe["answers"],
                "prediction": text,
                "seconds": round(time.perf_counter() - t, 4),
                "compress_seconds": round(compress_seconds, 4),
                "full_entries": conv["full_entries"],
                "kept_fraction": round(kept, 4),
                "entries_per_layer": per_layer,
            }
        )
    return records


def run(args: argparse.Namespace) -> int:
    """Answer the exported conversations with kvpress (module docstring); ``.venv-kvpress``."""
    import kvpress
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("kvpress").setLevel(logging.ERROR)  # KVzip's overhead warning, per pass
    data = json.loads(Path(args.conversations).read_text())
    if data.get("format") != FORMAT:
        raise SystemExit(f"{args.conversations}: not a file of `export` ({FORMAT})")
    if args.keep and data.get("prompt", "chat") != "chat":
        raise SystemExit("--keep needs the chat format (the plain format has no chat template)")
    for conv in data["conversations"]:
        conv["stops"] = data.get("stops", [])
    convs = data["conversations"][: args.limit] if args.limit else data["conversations"]
    budgets = parse_budgets(args.budgets)
    names = [s.strip() for s in args.presses.split(",") if s.strip()]
    unknown = [s for s in names if s not in PRESSES]
    if unknown:
        raise SystemExit(f"--presses: unknown {unknown}; known: {', '.join(PRESSES)}")
    passes = [(PRESSES[s], b) for s in names for b in budgets]
    if args.baseline:
        passes.insert(0, (NO_PRESS, 1.0))
    named = args.model_dir or data.get("model_dir")
    if not named or not (Path(named) / "config.json").exists():
        raise SystemExit(
            f"{named or 'no model_dir'}: no Hugging Face model folder; `export` records the one "
            "kvedit loads (run it again), or give --model-dir"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sizes = {c["id"]: len(c["probes"]) for c in convs}
    done = complete_groups(read_jsonl(out), sizes) if args.resume else []
    out.write_text("".join(json.dumps(r) + "\n" for r in done))
    have = {group_key(r) for r in done}
    model, tokenizer = load(Path(named))
    check = tokenizer(convs[0]["context_text"], add_special_tokens=False)["input_ids"]
    same_ids = list(check) == convs[0]["context_ids"]
    pipe = kvpress.KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
    versions = {
        "kvpress": importlib.metadata.version("kvpress"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "same_ids_as_kvedit": same_ids,
        "threads": args.threads,
    }
    print(json.dumps(versions), file=sys.stderr)
    t_all = time.perf_counter()
    for conv in convs:
        for press_name, budget in passes:
            if (conv["id"], press_name, budget, args.keep) in have:
                continue
            t0 = time.perf_counter()
            new = run_pass(pipe, conv, press_name, budget, args.keep, args.max_new_tokens)
            with open(out, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in new)
            print(
                f"{conv['id']} {press_name} @{budget:g}: kept {new[0]['kept_fraction']:.3f}, "
                f"{time.perf_counter() - t0:.1f} s",
                file=sys.stderr,
            )
    print(f"done in {time.perf_counter() - t_all:.0f} s: {out}", file=sys.stderr)
    if "kvedit" in sys.modules:  # pragma: no cover - the point of the separate venv
        raise SystemExit("run imported kvedit; it must not")
    meta = out.with_suffix(".meta.json")
    meta.write_text(json.dumps({**versions, "argv": sys.argv[1:]}, indent=2) + "\n")
    return 0


# -------------------------------------------------------------------------------- score


def score(args: argparse.Namespace) -> int:
    """Score the records and print the table (module docstring); kvedit's venv."""
    from kvedit.evals.memory_report import format_memory_table, summarize_memory
    from kvedit.evals.metrics import best_subspan_em

    records = []
    for path in args.records:
        records += read_jsonl(Path(path))
    rows = as_memory_records(records, best_subspan_em)
    if args.kvedit:
        from benchmarks.memory_table import latest, run_records

        examples = {r["example"] for r in rows}
        runs = [[r for r in run_records(d) if r["example"] in examples] for d in args.kvedit]
        rows = latest(runs)[0] + rows
    summary = summarize_memory(rows)
    print(format_memory_table(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


# ------------------------------------------------------------------------------ the command


def main(argv: Sequence[str] | None = None) -> int:
    first = (__doc__ or "").strip().split("\n\n")[0]
    ap = argparse.ArgumentParser(description=" ".join(first.split()))
    sub = ap.add_subparsers(dest="command", required=True)

    e = sub.add_parser("export", help="write the task's conversations (kvedit's venv)")
    e.add_argument("--task", default="nq-shared", choices=TASKS, help="eval memory's task")
    e.add_argument("--seed", type=int, default=1)
    e.add_argument("--size", type=int, default=12, help="documents (nq-shared) or messages")
    e.add_argument("--questions", type=int, default=9, help="questions per conversation")
    e.add_argument("--n-examples", type=int, default=7, help="conversations")
    e.add_argument("--model", default=MODEL, help=f"whose tokenizer renders ({MODEL})")
    e.add_argument("--out", default=str(DEFAULT_OUT / "conversations.json"))
    e.set_defaults(fn=export)

    r = sub.add_parser("run", help="answer them with kvpress (.venv-kvpress)")
    r.add_argument("--conversations", default=str(DEFAULT_OUT / "conversations.json"))
    r.add_argument("--budgets", default="0.25,0.1", help="fractions of the context kept")
    r.add_argument("--presses", default="kvzip,snapkv", help=", ".join(PRESSES))
    r.add_argument("--baseline", action="store_true", help="also no press (budget 1)")
    r.add_argument("--keep", action="store_true", help="keep each question and answer")
    r.add_argument("--limit", type=int, default=0, help="the first N conversations (0: all)")
    r.add_argument("--max-new-tokens", type=int, default=12)
    r.add_argument("--threads", type=int, default=1, help="torch threads")
    r.add_argument("--model-dir", default=None, help="HF model folder (default: the export's)")
    r.add_argument("--out", default=str(DEFAULT_OUT / "records.jsonl"))
    r.add_argument("--resume", action="store_true", help="keep the finished passes in --out")
    r.set_defaults(fn=run)

    s = sub.add_parser("score", help="score the records and print the table (kvedit's venv)")
    s.add_argument("records", nargs="+", help="records.jsonl files of `run`")
    s.add_argument(
        "--kvedit", nargs="+", default=None, help="kvedit eval memory results folders to add"
    )
    s.add_argument("--json", default=None, help="write the summary here")
    s.set_defaults(fn=score)

    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
