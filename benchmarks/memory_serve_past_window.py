"""A memory past the model's window through ``kvedit serve``: the long facts conversation of
``memory_past_window`` (about four times the model's positions) sent live to the real server
under a byte budget of ``--entries`` entries per layer, then every fact asked through it, against
an in-process ``kvedit.Memory`` with the server's budget form reading the same messages.

The conversation is :func:`benchmarks.memory_past_window.stretched` (``--facts`` facts, ``--filler``
chat pairs after each early pair). To keep the run short it is sent in big turns: its
consecutive user and assistant messages are grouped, in order, into user messages of at most
``--group-tokens`` tokens (by the model's tokenizer), each original message one line with its
speaker (``User: ...`` / ``Assistant: ...``), cut only before a user line. A client
(the ``openai`` package, greedy) sends the whole message list each request, as a chat client
does: each grouped message with ``max_tokens=1`` (as ``memory_serve_recall`` reads), the model's
real one-token answer appended, stripped, as the assistant's message (as ``memory_serve_exact``
does), until the whole conversation is read; then each fact's question is asked
(``max_tokens=--new-tokens``) on the same message list, so every question is served from the
memory of the last grouped message and none is remembered. The server is started with
``--memory-max-bytes`` = ``--entries`` x the model's float32 K/V bytes per token (SmolLM2:
46,080, so 2,048 x 46,080) and ``--forget``; its memories keep the same tokens on every layer and
give them compact positions at every commit.

Reported: turns sent, the tokens read (each request's ``kv_transfer_params.kvedit``: ``computed``
summed over the turns is the new tokens vLLM read; ``served`` + ``computed`` is a request's engine
prompt, its largest against the model's positions), requests refused (HTTP errors) and turns
answered but not kept (``error``), the memory's bytes at the end and at most against the budget,
and recall (exact match of the gold in the answer, as ``memory_past_window`` scores) by where the
fact was stated (early, middle, late third). The same facts are asked (``remember=False``) of a
``kvedit.Memory(max_bytes=the budget, keep="token", reposition="always", forget=--forget)`` that
asked the same grouped messages with ``max_new_tokens=1``.

Run in the vLLM venv (``make vllm-setup``)::

    .venv-vllm/bin/python -m benchmarks.memory_serve_past_window --seeds 1 --threads 1 \\
        --out runs/memory_serve_past_window.json
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import RUNS, add_model, command_line, markdown_table, parser, write_json
from benchmarks.memory_past_window import add_conversation_args, stretched
from benchmarks.memory_serve import bytes_per_token, free_port, running_server

START_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 600
BUCKETS = ("early", "middle", "late")
LABELS = {"user": "User", "assistant": "Assistant"}


def grouped(messages: Sequence[tuple[str, str]], count, limit: int) -> tuple[list[str], list[int]]:
    """``(groups, where)``: ``messages`` (the system message excluded) as user messages of at
    most ``limit`` tokens by ``count`` (a text's token count; one message over it is a group of
    its own), each message a ``Speaker: text`` line, a group cut only before a user line;
    ``where[i]``: the group holding message ``i`` of ``messages``."""
    if limit < 1:
        raise ValueError(f"--group-tokens must be >= 1, got {limit}")
    groups: list[list[str]] = []
    where: list[int] = []
    tokens = 0
    for role, content in messages:
        line = f"{LABELS.get(role, role.capitalize())}: {content}"
        n = count(line + "\n")
        # a group ends before a user line that would take it past the limit
        if not groups or (role == "user" and tokens + n > limit and groups[-1]):
            groups.append([])
            tokens = 0
        groups[-1].append(line)
        tokens += n
        where.append(len(groups) - 1)
    return ["\n".join(g) for g in groups], where


def request(client, model: str, messages: list[dict], tokens: int, budget: int) -> dict[str, Any]:
    """One greedy chat request: its answer, wall time and what ``kvedit`` said; a refusal (an
    HTTP error) is recorded as ``refused``, with an empty answer."""
    import openai

    params = {"kv_transfer_params": {"kvedit": {"max_bytes": budget}}}
    t0 = time.perf_counter()
    try:
        r = client.chat.completions.create(
            model=model, messages=messages, max_tokens=tokens, temperature=0, extra_body=params
        )
    except openai.APIStatusError as e:
        return {"answer": "", "refused": f"{e.status_code}: {e.message}"[:500]}
    said = ((r.model_extra or {}).get("kv_transfer_params") or {}).get("kvedit") or {}
    return {
        "answer": (r.choices[0].message.content or "").strip(),
        "wall_s": round(time.perf_counter() - t0, 3),
        "prompt_tokens": r.usage.prompt_tokens if r.usage else None,
        **{k: said.get(k) for k in ("served", "computed", "memory_bytes", "forgot", "error")},
    }


def serve(url: str, model: str, system: str, groups, questions, args, budget: int) -> dict:
    """The grouped conversation through the server, then each question on the last message
    list: ``{"turns": [...], "questions": [...]}``, one request's record each."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=REQUEST_TIMEOUT_S)
    messages = [{"role": "system", "content": system}]
    turns = []
    for t, text in enumerate(groups):
        messages.append({"role": "user", "content": text})
        turns.append(request(client, model, messages, 1, budget))
        messages.append({"role": "assistant", "content": turns[-1]["answer"]})
        row = turns[-1]
        print(
            f"turn {t + 1}/{len(groups)}: served {row.get('served')} computed "
            f"{row.get('computed')} bytes {row.get('memory_bytes')} "
            f"{row.get('refused') or row.get('error') or ''}",
            flush=True,
        )
    asked = [
        request(client, model, [*messages, {"role": "user", "content": q}], args.new_tokens, budget)
        for q in questions
    ]
    return {"turns": turns, "questions": asked}


def in_process(model, tok, system: str, groups, questions, args, budget: int) -> dict:
    """The same grouped messages asked of an in-process memory with the server's budget form,
    then each question without remembering it."""
    from kvedit import Memory

    mem = Memory(
        model,
        tok,
        system=system,
        max_bytes=budget,
        keep="token",
        reposition="always",
        forget=args.forget,
    )
    t0 = time.perf_counter()
    answers = [mem.ask(text, max_new_tokens=1) for text in groups]
    read_s = time.perf_counter() - t0
    asked = [mem.ask(q, args.new_tokens, remember=False) for q in questions]
    steps = [s for s in mem.state.history.steps if s.kind == "reposition"]
    return {
        "turn_answers": answers,
        "answers": asked,
        "tokens_read": sum(t.n_tokens for t in mem.turns),
        "entries_per_layer": max(layer.keys.shape[-2] for layer in mem.state.layers),
        "bytes": mem.nbytes,
        "compactions": len(steps),
        "read_seconds": round(read_s, 1),
    }


def _recall(rows: Sequence[dict], key: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("all", *BUCKETS):
        mine = [r[key] for r in rows if name in ("all", r["bucket"])]
        out[name] = [int(sum(mine)), len(mine)]
    return out


def scored(facts, where, served: Sequence[dict], local: Sequence[str]) -> list[dict]:
    """Each fact with the group it was stated in, both answers and whether each is right."""
    from kvedit.evals.metrics import best_subspan_em

    return [
        {
            **f,
            "group": where[f["message"] - 1],
            "served": q.get("answer", ""),
            "served_correct": int(best_subspan_em(q.get("answer", ""), f["answers"])),
            "in_process": a,
            "in_process_correct": int(best_subspan_em(a, f["answers"])),
            "refused": q.get("refused"),
        }
        for f, q, a in zip(facts, served, local, strict=True)
    ]


def run_seed(model, tok, seed: int, args, budget: int) -> dict:
    """One seed: the conversation served, then in process."""
    messages, facts = stretched(seed, args.facts, args.filler)
    system = messages[0][1]

    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    groups, where = grouped(messages[1:], count, args.group_tokens)
    questions = [f["question"] for f in facts]
    root = Path(tempfile.mkdtemp(prefix="kvedit-past-window-"))
    port = free_port()
    cmd = [sys.executable, "-m", "kvedit", "serve", "--model", args.model, "--root", str(root)]
    cmd += ["--port", str(port), "--memory-max-bytes", str(budget), "--forget", args.forget]
    t0 = time.perf_counter()
    with running_server(cmd, port, root.with_suffix(".log"), START_TIMEOUT_S) as url:
        t1 = time.perf_counter()
        served = serve(url, args.model, system, groups, questions, args, budget)
    serve_s = time.perf_counter() - t1
    local = in_process(model, tok, system, groups, questions, args, budget)
    turns = served["turns"]
    rows = scored(facts, where, served["questions"], local["answers"])
    engine = [(r.get("served") or 0) + (r.get("computed") or 0) for r in turns]
    requests = turns + served["questions"]
    return {
        "seed": seed,
        "messages": len(messages),
        "turns_sent": len(turns),
        "questions": len(rows),
        "computed_tokens": sum(r.get("computed") or 0 for r in turns),
        "served_tokens": sum(r.get("served") or 0 for r in turns),
        "max_engine_prompt": max(engine, default=0),
        "refused": [r["refused"] for r in requests if r.get("refused")],
        "not_kept": [r["error"] for r in requests if r.get("error")],
        "bytes_end": turns[-1].get("memory_bytes") if turns else None,
        "bytes_max": max((r.get("memory_bytes") or 0 for r in requests), default=0),
        "same_turn_answers": sum(
            r["answer"] == a for r, a in zip(turns, local["turn_answers"], strict=True)
        ),
        "same_answers": sum(r["served"] == r["in_process"] for r in rows),
        "served_recall": _recall(rows, "served_correct"),
        "in_process_recall": _recall(rows, "in_process_correct"),
        "in_process": {k: v for k, v in local.items() if k not in ("answers", "turn_answers")},
        "start_seconds": round(t1 - t0, 1),
        "serve_seconds": round(serve_s, 1),
        "server_log": str(root.with_suffix(".log")),
        "turns": turns,
        "facts": rows,
    }


def table(rows: Sequence[dict], budget: int, per_token: int) -> list[str]:
    """The markdown table of the seeds' runs."""

    def frac(pair) -> str:
        return f"{pair[0]} of {pair[1]}"

    out = []
    for r in rows:
        out.append(
            [
                r["seed"],
                r["turns_sent"],
                f"{r['in_process']['tokens_read']:,}",
                f"{r['computed_tokens']:,}",
                f"{r['max_engine_prompt']:,}",
                len(r["refused"]),
                f"{r['bytes_end']:,} ({(r['bytes_end'] or 0) // per_token:,} entries)",
                f"{budget:,}",
                frac(r["served_recall"]["all"]),
                frac(r["in_process_recall"]["all"]),
                frac(r["served_recall"]["late"]),
                frac(r["in_process_recall"]["late"]),
            ]
        )
    head = ["seed", "turns sent", "tokens read", "computed by vLLM", "largest engine prompt"]
    head += ["refused", "memory bytes at the end", "budget", "recall served"]
    head += ["recall in process", "late facts served", "late facts in process"]
    return markdown_table(head, out)


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    add_model(p)
    add_conversation_args(p)
    p.add_argument("--entries", type=int, default=2048, help="budget in entries per layer (2048)")
    p.add_argument("--forget", default="learned", help="the policy (the server's: learned)")
    p.add_argument("--group-tokens", type=int, default=400, help="tokens per sent message (400)")
    p.add_argument("--new-tokens", type=int, default=16, help="most tokens per answer (16)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (and the server's)")
    p.add_argument("--out", default=str(RUNS / "memory_serve_past_window.json"))
    args = p.parse_args(argv)
    if args.entries < 1:
        p.error(f"--entries must be >= 1, got {args.entries}")
    seeds = [int(s) for s in args.seeds.split(",")]
    import torch

    import kvedit

    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the server inherits it
    model, tok = kvedit.load_model(args.model)
    per_token = bytes_per_token(model.config)
    budget = args.entries * per_token
    rows = []
    for seed in seeds:
        rows.append(run_seed(model, tok, seed, args, budget))
        summary = {k: v for k, v in rows[-1].items() if k not in ("turns", "facts")}
        print(summary, flush=True)
        write_json(
            args.out,
            {
                "command": command_line(__file__, argv),
                "model": args.model,
                "forget": args.forget,
                "budget_bytes": budget,
                "bytes_per_token": per_token,
                "rows": rows,
            },
        )
    print("\n".join(table(rows, budget, per_token)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
