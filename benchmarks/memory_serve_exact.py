"""A conversation served by ``kvedit serve`` against the same conversation in an in-process
``kvedit.Memory``: the answers turn by turn (greedy), and each turn's memory entry by entry.

The user messages are a facts conversation's (``kvedit eval memory --task facts``); the client
(the ``openai`` package) sends the whole message list each turn, every other turn streamed, and
appends the answer it got, stripped as ``Memory.ask`` returns and keeps it. Then a
``kvedit.Memory`` with the same budget as the server's memories (``keep="token"``,
``reposition="always"``) asks the same user messages. Per turn: whether the answers are equal,
and between the served memory (its file, found by the response's ``memory_digest``) and the
in-process one: whether they hold the same tokens (the served memory computes an answer's
closing markup at the commit, as ``Memory.ask`` does, so both hold the whole conversation and
forget at the same point), the share of entries that are the same tokens (per layer), and the
largest difference of the same entries' keys (the in-process ones given the compact positions
the served memory has at once and the in-process one before its next question) and values (vLLM
computes them with its own kernels).

Run in the vLLM venv (``make vllm-setup``)::

    .venv-vllm/bin/python -m benchmarks.memory_serve_exact --model smollm2-135m-instruct \\
        --turns 30 [--max-bytes 2MiB] [--out runs/memory_serve_exact.json]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks.common import DEFAULT_MODEL, RUNS, parser, write_json
from benchmarks.memory_serve import free_port, running_server

START_TIMEOUT_S = 600
MEMORY_WAIT_S = 60.0


def conversation(turns: int, seed: int) -> tuple[str | None, list[str]]:
    """``(system, user messages)`` of a facts conversation."""
    from kvedit.evals.tasks.memory_facts import facts_examples

    conv = facts_examples(1, seed, n_messages=max(2 * turns, 20))[0]
    system = next((c for r, c in conv.messages if r == "system"), None)
    users = [c for r, c in conv.messages if r == "user"]
    users += [p.question for p in conv.probes]
    return system, users[:turns]


def chat(url: str, model: str, system, users, tokens: int, max_bytes, keep: Path) -> list[dict]:
    """Drive the conversation through the server; one row per turn. Each turn's memory file is
    copied to ``keep`` (the server keeps a conversation's last two only)."""
    import openai

    from kvedit.integrations.vllm.conversations import MEMORIES

    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    messages = [{"role": "system", "content": system}] if system else []
    params = {"kv_transfer_params": {"kvedit": {"max_bytes": max_bytes}}}
    extra = {"extra_body": params} if max_bytes else {}
    rows = []
    for t, text in enumerate(users):
        messages.append({"role": "user", "content": text})
        kw = dict(model=model, messages=messages, max_tokens=tokens, temperature=0, **extra)
        t0 = time.perf_counter()
        first = None
        if t % 2:
            said, parts = None, []
            for chunk in client.chat.completions.create(stream=True, **kw):
                if chunk.choices:
                    first = first or time.perf_counter()
                    parts.append(chunk.choices[0].delta.content or "")
                else:
                    said = (chunk.model_extra or {}).get("kv_transfer_params")
            answer = "".join(parts)
        else:
            r = client.chat.completions.create(**kw)
            answer = r.choices[0].message.content or ""
            said = (r.model_extra or {}).get("kv_transfer_params")
        wall = time.perf_counter() - t0
        kvedit = (said or {}).get("kvedit") or {}
        digest = kvedit.get("memory_digest")
        if digest:
            kept_memory(keep.parent / MEMORIES, digest, keep)
        rows.append(
            {
                "turn": t,
                "streamed": bool(t % 2),
                "answer": answer,
                "ttft_s": (first - t0) if first else None,
                "wall_s": wall,
                **{f"served_{k}": v for k, v in kvedit.items()},
            }
        )
        # what the client sends back: the answer as a kvedit.Memory keeps it (stripped)
        messages.append({"role": "assistant", "content": answer.strip()})
    return rows


def kept_memory(folder: Path, digest: str, keep: Path, timeout: float = MEMORY_WAIT_S) -> bool:
    """Copy memory ``digest`` from ``folder`` to ``keep`` once it is there (the server writes a
    turn's memory after its response has ended; the file appears whole: written atomically).
    False when it did not appear within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        for path in folder.glob(f"*-{digest}.safetensors"):
            shutil.copy(path, keep / path.name)
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def plain_request(url: str, model: str, system, users, rows) -> dict:
    """The whole conversation as one prompt to the same vLLM (what a server without memories
    computes at the last turn): its HTTP status and, when refused, vLLM's message."""
    import json
    import urllib.error
    import urllib.request

    messages = [{"role": "system", "content": system}] if system else []
    for text, row in zip(users, rows, strict=True):
        messages += [{"role": "user", "content": text}]
        messages += [{"role": "assistant", "content": row["answer"].strip()}]
    body = {"model": model, "messages": messages, "max_tokens": 1}
    body["kv_transfer_params"] = None
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps({**body, "echo": True}).encode(),  # echo: the memories pass it on
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return {"status": r.status}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "message": e.read().decode()[:300]}


def compare(served, held) -> dict:
    """Entries of two memories' states, layer by layer, over the tokens the served one holds:
    the share that are the same tokens, and the largest |difference| of the same entries (the
    in-process ``held`` given compact positions first, as the served memory has them)."""
    from kvedit.memory.repositioning import compact_positions, is_compact

    if is_compact(served) and not is_compact(held):
        held = compact_positions(held, reason="always")
    n = len(served)
    same = total = 0
    diff = 0.0
    for a, b in zip(served.layers, held.layers, strict=True):
        ia, ib = a.token_index.tolist(), b.token_index.tolist()
        keep_b = [j for j, t in enumerate(ib) if 0 <= t < n]
        sa, sb = set(ia), {ib[j] for j in keep_b}
        same += len(sa & sb)
        total += max(len(sa), len(sb))
        where_b = {ib[j]: j for j in keep_b}
        common = [(j, where_b[t]) for j, t in enumerate(ia) if t in where_b]
        if common:
            ja = torch.tensor([c[0] for c in common])
            jb = torch.tensor([c[1] for c in common])
            for x, y in ((a.keys, b.keys), (a.values, b.values)):
                d = (x[0][:, ja].float() - y[0][:, jb].float()).abs().max()
                diff = max(diff, float(d))
    return {"same_tokens": same / max(total, 1), "max_abs_diff": diff}


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--answer-tokens", type=int, default=24, help="max_tokens per answer")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-bytes", default=None, help="per-conversation budget, e.g. 2MiB")
    ap.add_argument("--forget", default="learned")
    ap.add_argument("--out", default=str(RUNS / "memory_serve_exact.json"))
    ap.add_argument(
        "vllm_args", nargs="*", help="after --: vLLM server arguments (--max-model-len 512)"
    )
    args = ap.parse_args(argv)
    import kvedit
    from kvedit.cli.arguments import byte_size
    from kvedit.states.files.read import read_attached

    max_bytes = byte_size("--max-bytes")(args.max_bytes) if args.max_bytes else None
    system, users = conversation(args.turns, args.seed)
    root = Path(tempfile.mkdtemp(prefix="kvedit-chat-"))
    cmd = [sys.executable, "-m", "kvedit", "serve", "--model", args.model, "--root", str(root)]
    port = free_port()
    cmd += ["--port", str(port)]
    if max_bytes:  # the server's own budget too (each request also names it)
        cmd += ["--memory-max-bytes", str(max_bytes), "--forget", args.forget]
    cmd += ["--", *args.vllm_args] if args.vllm_args else []
    keep = root / "kept"
    keep.mkdir()
    with running_server(cmd, port, root.with_suffix(".log"), START_TIMEOUT_S) as url:
        rows = chat(url, args.model, system, users, args.answer_tokens, max_bytes, keep)
        whole = plain_request(url, args.model, system, users, rows)
    model, tok = kvedit.load_model(args.model)
    # the server's memories: the same tokens on every layer and head, compact positions
    budget = {"max_bytes": max_bytes, "forget": args.forget, "keep": "token"}
    budget["reposition"] = "always"
    mem = kvedit.Memory(model, tok, system=system, **(budget if max_bytes else {}))
    for row, text in zip(rows, users, strict=True):
        row["in_process"] = mem.ask(text, max_new_tokens=args.answer_tokens)
        row["same_answer"] = row["in_process"] == row["answer"].strip()
        digest = row.get("served_memory_digest")
        found = list(keep.glob(f"*-{digest}.safetensors")) if digest else []
        row["conversation_tokens"] = len(mem.state)
        if found:
            served = read_attached(found[0], model, tok).state
            row["same_ids"] = served.token_ids.tolist() == mem.state.token_ids.tolist()
            row.update(compare(served, mem.state))
            row["in_process_bytes"] = mem.nbytes
    summary = {
        "model": args.model,
        "turns": len(rows),
        "max_bytes": max_bytes,
        "same_answers": sum(r["same_answer"] for r in rows),
        "same_ids_turns": sum(bool(r.get("same_ids")) for r in rows),
        "min_same_tokens": min((r.get("same_tokens", 0.0) for r in rows), default=0.0),
        "mean_same_tokens": sum(r.get("same_tokens", 0.0) for r in rows) / max(len(rows), 1),
        "max_abs_diff": max((r.get("max_abs_diff", 0.0) for r in rows), default=0.0),
        "max_memory_bytes": max((r.get("served_memory_bytes") or 0 for r in rows), default=0),
        "max_engine_prompt": max(
            (r.get("served_served", 0) + r.get("served_computed", 0) for r in rows), default=0
        ),
        "conversation_tokens": len(mem.state),
        "mean_computed": sum(r.get("served_computed", 0) for r in rows) / max(len(rows), 1),
        "errors": [r["served_error"] for r in rows if r.get("served_error")],
        "whole_conversation_as_one_prompt": whole,
    }
    write_json(args.out, {"summary": summary, "rows": rows, "command": sys.argv})
    for r in rows:
        print(
            f"turn {r['turn']:2d} same={r['same_answer']!s:5} tokens={r.get('same_tokens', 0):.4f} "
            f"diff={r.get('max_abs_diff', 0):.2e} served={r.get('served_served')} "
            f"computed={r.get('served_computed')} bytes={r.get('served_memory_bytes')} "
            f"forgot={r.get('served_forgot')}"
        )
    print(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
