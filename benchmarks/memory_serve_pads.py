"""Which pad form serves a forgetting memory as well as in process (issue #68, item 1): the 36
questions of ``memory_serve_recall`` (``--n-examples 4 --facts 9``) answered over six caches at
each budget, every answer greedy from a plain transformers forward over a ``DynamicCache`` of
the row's K/V (explicit positions).

Rows (``ROWS``), at each ``--budgets`` fraction of the conversation's bytes (of its global
layers' bytes; sliding layers held whole, as no round forgets them):

* ``default``: ``kvedit.Memory(max_bytes=, forget="learned")`` as it forgets by default (one
  ranking over the layers, each layer its own count);
* ``equal_heads``: one count on every (global layer, KV head), each head its own best entries
  by the learned scores, cut once from the whole conversation (protected as the memory's);
* ``same_tokens``: ``Memory(keep="token")``, the same tokens on every layer (served today);
* ``null_pads``: ``default`` padded to the largest layer's count with zero keys and values;
* ``calibrated_pads``: pad keys per (layer, KV head) from another seed's conversation
  (:func:`calibrate`), value zero;
* ``masked_pads``: ``null_pads`` under an additive ``-inf`` mask (``default`` up to float
  error: the largest first-token logit difference is reported).

Each attention module gets its own ``attention_mask`` (transformers builds one for all layers)
from a torch ``register_forward_pre_hook`` (nothing is patched). Per row: questions right, the
largest softmax weight on a pad (over the cached slots: an upper bound), the slots vLLM must
hold (global layers x the largest count, plus sliding layers) against the memory's entries.

Usage: ``python -m benchmarks.memory_serve_pads --model smollm2-135m-instruct --threads 1
--out runs/serve_pads_smollm2.json``.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from benchmarks.common import DEFAULT_MODEL, RUNS, markdown_table, parser, write_json
from kvedit.compat import cache_kwarg
from kvedit.errors import InvalidInputError

ROWS = ("default", "equal_heads", "same_tokens", "null_pads", "calibrated_pads", "masked_pads")
PAD_LOGIT = 100.0
"""How far below zero the calibration query least aligned with a pad key puts its logit."""


@dataclass(frozen=True)
class Slots:
    """One layer's cache: post-RoPE ``keys``/``values`` ``[1, kv_heads, n, d]``, each slot's
    ``pos`` and ``pad`` ``[kv_heads, n]`` (a pad's pos -1), ``window`` (None: global)."""

    keys: torch.Tensor
    values: torch.Tensor
    pos: torch.Tensor
    pad: torch.Tensor
    window: int | None

    def held(self) -> int:  # entries, summed over KV heads
        return int((~self.pad).sum())


def slots_of(layer) -> Slots:
    """A kvedit ``LayerKV`` (dense or headwise) as :class:`Slots`."""
    heads = layer.keys.shape[1]
    if getattr(layer, "head_index", None) is not None:
        pad = layer.head_index < 0
        pos = layer.head_positions.masked_fill(pad, -1)
    else:
        pos = layer.positions[None].expand(heads, -1).clone()
        pad = torch.zeros_like(pos, dtype=torch.bool)
    return Slots(layer.keys, layer.values, pos, pad, layer.window)


def padded(s: Slots, n: int, key: torch.Tensor | None = None) -> Slots:
    """``s`` with pad slots appended up to ``n``: key ``key`` ``[kv_heads, d]`` (None: zero),
    value zero."""
    extra, heads = n - s.keys.shape[2], s.keys.shape[1]
    k = torch.zeros(1, heads, max(extra, 0), s.keys.shape[3], dtype=s.keys.dtype)
    k += 0 if key is None else key[None, :, None].to(k.dtype)
    v = torch.zeros(1, heads, k.shape[2], s.values.shape[3], dtype=s.values.dtype)
    pos = torch.cat([s.pos, torch.full((heads, k.shape[2]), -1, dtype=s.pos.dtype)], 1)
    pad = torch.cat([s.pad, torch.ones(heads, k.shape[2], dtype=torch.bool)], 1)
    keys, values = torch.cat([s.keys, k], 2), torch.cat([s.values, v], 2)
    return replace(s, keys=keys, values=values, pos=pos, pad=pad)


def per_head_top(layer, scores: torch.Tensor, protected: torch.Tensor, k: int) -> Slots:
    """Each KV head of a dense ``layer`` keeping its own ``k`` best entries by ``scores``
    ``[kv_heads, n]`` (``protected`` ``[n]`` always), in token order."""
    s = scores.float().masked_fill(protected[None], float("inf"))
    idx = s.topk(min(k, s.shape[1]), dim=1).indices.sort(dim=1).values  # [heads, k]
    keys, values = (t.gather(2, idx[None, :, :, None].expand(1, -1, -1, t.shape[3]))
                    for t in (layer.keys, layer.values))  # fmt: skip
    pos = layer.positions[idx]
    return Slots(keys, values, pos, torch.zeros_like(pos, dtype=torch.bool), layer.window)


def post_rope_queries(module, kwargs: dict) -> torch.Tensor:
    """``[batch, heads, q, d]``: the queries an attention module computes from its inputs
    (its own ``q_proj``, ``q_norm`` where it has one, and the cos/sin it is given)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    hs = kwargs["hidden_states"]
    q = module.q_proj(hs).view(*hs.shape[:-1], -1, module.head_dim)
    q = (module.q_norm(q) if hasattr(module, "q_norm") else q).transpose(1, 2)
    return apply_rotary_pos_emb(q, q, *kwargs["position_embeddings"])[0]


class Runner:
    """The model with a pre-hook on each attention module: it hands the module
    ``masks[layer]`` as its ``attention_mask`` (when set), and, when ``watch``, records the
    largest softmax weight any pad slot gets over the cached slots; when ``collect``, keeps the
    post-RoPE queries."""

    def __init__(self, model) -> None:
        self.model = model
        self.masks: dict[int, torch.Tensor] | None = None
        self.slots: list[Slots] = []
        self.cache, self.watch, self.pad_weight = None, False, 0.0
        self.collect: dict[int, list[torch.Tensor]] | None = None
        self.attn = [layer.self_attn for layer in model.model.layers]
        for i, module in enumerate(self.attn):
            module.register_forward_pre_hook(self._hook(i), with_kwargs=True)

    def _hook(self, i: int):
        def hook(module, args, kwargs):
            if self.collect is not None:
                self.collect.setdefault(i, []).append(post_rope_queries(module, kwargs)[0])
            if self.masks is None:
                return None
            mask = self.masks[i]
            if self.watch and bool(self.slots[i].pad.any()):
                self.pad_weight = max(self.pad_weight, self._pad_weight(i, module, kwargs, mask))
            return args, {**kwargs, "attention_mask": mask}

        return hook

    def _pad_weight(self, i: int, module, kwargs: dict, mask: torch.Tensor) -> float:
        q = post_rope_queries(module, kwargs)  # [1, H, q, d]
        keys = self.cache.layers[i].keys  # the cached slots (before this step's update)
        group = q.shape[1] // keys.shape[1]
        k = keys.repeat_interleave(group, dim=1)
        logits = (q @ k.transpose(-1, -2)) * module.scaling + mask[..., : k.shape[2]]
        probs = logits.float().softmax(-1)
        pad = self.slots[i].pad.repeat_interleave(group, dim=0)  # [H, n]: the cached slots'
        return float(probs.masked_fill(~pad[None, :, None], 0).max())


def layer_mask(s: Slots, q_pos: torch.Tensor, masked: bool, heads: int) -> torch.Tensor:
    """``[1, heads, q, n]`` additive mask for queries at ``q_pos`` over ``s``'s slots (the new
    tokens already appended to ``s``): causal, the window, and pads ``-inf`` if ``masked``."""
    qp = q_pos[None, :, None]  # [1, q, 1]
    kp = s.pos[:, None, :]  # [kv_heads, 1, n]
    ok = kp <= qp
    if s.window is not None:
        ok &= kp > qp - s.window
    pad = s.pad[:, None, :]
    ok = torch.where(pad, torch.tensor(not masked), ok)
    ok = ok.repeat_interleave(heads // s.pos.shape[0], dim=0)
    return torch.zeros(ok.shape, dtype=s.keys.dtype).masked_fill(~ok, float("-inf"))[None]


def grown(s: Slots, positions: torch.Tensor) -> Slots:
    """``s``'s bookkeeping with real slots at ``positions`` appended (the K/V live in the
    cache)."""
    heads = s.pos.shape[0]
    pos = torch.cat([s.pos, positions[None].expand(heads, -1)], 1)
    pad = torch.cat([s.pad, torch.zeros(heads, len(positions), dtype=torch.bool)], 1)
    return replace(s, pos=pos, pad=pad)


def generate(
    runner: Runner,
    layers: list[Slots],
    ids: list[int],
    start: int,
    masked: bool,
    max_new: int,
    eos: set[int],
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens after ``ids`` (at positions from ``start``) over ``layers``, and the first
    token's logits."""  # fmt: skip
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, s in enumerate(layers):
        cache.update(s.keys.clone(), s.values.clone(), i)
    heads = runner.model.config.num_attention_heads
    runner.cache, out, first, tokens = cache, [], None, torch.tensor([ids])
    for _ in range(max_new):
        pos = torch.arange(start, start + tokens.shape[1])
        runner.slots = layers
        layers = [grown(s, pos) for s in layers]
        runner.masks = {i: layer_mask(s, pos, masked, heads) for i, s in enumerate(layers)}
        with torch.no_grad():
            kwargs = {cache_kwarg(runner.model): cache}
            logits = runner.model(
                input_ids=tokens, position_ids=pos[None], use_cache=True, **kwargs
            ).logits[0, -1]
        first = logits if first is None else first
        nxt = int(logits.argmax())
        if nxt in eos:
            break
        out.append(nxt)
        start, tokens = start + tokens.shape[1], torch.tensor([[nxt]])
    runner.masks = None
    return out, first


def calibrate(runner: Runner, ids: list[int]) -> dict[int, tuple[torch.Tensor, float]]:
    """``{layer: (pad keys [kv_heads, d], least alignment)}`` from the post-RoPE queries of a
    forward over ``ids``: minus each KV head's mean query direction, scaled so the least aligned
    query's logit is ``-PAD_LOGIT`` (a query on the other side shows in the pad weight)."""
    runner.collect = {}
    with torch.no_grad():
        runner.model(input_ids=torch.tensor([ids]))
    got, runner.collect = runner.collect, None
    out = {}
    for i, qs in got.items():
        q = qs[0]  # [H, T, d]
        q = q.reshape(runner.model.config.num_key_value_heads, -1, q.shape[-1])  # by KV head
        u = q.mean(1)
        u = u / u.norm(dim=-1, keepdim=True)
        least = (q * u[:, None]).sum(-1).amin(1)  # [kv_heads]
        scale = PAD_LOGIT / (runner.attn[i].scaling * least.clamp(min=1e-3))
        out[i] = (-u * scale[:, None], float(least.min()))
    return out


def protected_tokens(memory, n: int) -> torch.Tensor:
    """``[n]`` bool: what no round drops (first tokens, system message, last tokens)."""
    from kvedit.memory.budget import RECENT_TOKENS
    from kvedit.memory.forgetting import SINK_TOKENS

    kept = torch.zeros(n, dtype=torch.bool)
    kept[:SINK_TOKENS] = True
    kept[-RECENT_TOKENS:] = True
    for t in memory.turns:
        if t.role == "system":
            kept[t.start : t.end] = True
    return kept


def accounting(layers: list[Slots], glob: Sequence[int]) -> dict:
    """Entries a row's memory holds (per KV head, summed over layers) against the slots vLLM's
    paged cache must hold for it: every global layer the largest count of any (layer, head),
    each sliding layer what it holds; bytes of those slots."""
    heads = layers[0].pos.shape[0]
    real = [int((~s.pad).sum(1).max()) for s in layers]  # the longest head of each layer
    entries = sum(s.held() for s in layers) / heads
    sliding = [i for i in range(len(layers)) if i not in glob]
    slots = len(glob) * max(real[i] for i in glob) + sum(real[i] for i in sliding)
    k, v = layers[0].keys, layers[0].values
    per_slot = heads * (k.shape[3] + v.shape[3]) * k.element_size()
    return {"entries": entries, "vllm_slots": slots, "vllm_bytes": slots * per_slot}


def row_layers(full, mem_a, mem_c, scores, protected, pads) -> dict[str, tuple[list, bool]]:
    """``{row: (layers, masked)}`` of one budget (module docstring)."""
    glob = full.state.global_layers
    a = [slots_of(layer) for layer in mem_a.state.layers]
    heads = a[0].pos.shape[0]
    k = round(sum(a[i].held() for i in glob) / (len(glob) * heads))
    longest = max(a[i].keys.shape[2] for i in glob)

    def pad(key_of) -> list[Slots]:
        return [padded(s, longest, key_of(i)) if i in glob else s for i, s in enumerate(a)]

    equal = [
        per_head_top(full.state.layers[i], scores[i][0], protected, k) if i in glob else s
        for i, s in enumerate(a)
    ]
    return {
        "default": (a, False),
        "equal_heads": (equal, False),
        "same_tokens": ([slots_of(layer) for layer in mem_c.state.layers], False),
        "null_pads": (pad(lambda i: None), False),
        "calibrated_pads": (pad(lambda i: pads[i][0]), False),
        "masked_pads": (pad(lambda i: None), True),
    }


@dataclass
class Setup:  # what every question's rows need
    model: object
    tok: object
    runner: Runner
    pads: dict
    eos: set[int]
    max_new: int


def budget_bytes(state, fraction: float) -> int:
    """``fraction`` of the global layers' bytes plus the sliding layers' (no round forgets a
    window): ``fraction`` of ``state.nbytes`` where all are global, as ``memory_serve_recall``."""
    glob = sum(state.layers[i].nbytes for i in state.global_layers)
    return int(state.nbytes - glob + fraction * glob)


def run_budget(setup: Setup, conv, full, scores, protected, fraction: float) -> list[dict]:
    """Records (one per question and row) of one conversation at one budget."""
    import kvedit
    from kvedit.evals.metrics import best_subspan_em
    from kvedit.memory.rendering import Message

    budget = budget_bytes(full.state, fraction)
    mems, kw = {}, {"max_bytes": budget, "forget": "learned"}
    for keep in ("auto", "token"):
        mems[keep] = kvedit.Memory(setup.model, setup.tok, keep=keep, **kw)
        for role, content in conv.messages:
            mems[keep].add(role, content)
    rows = row_layers(full, mems["auto"], mems["token"], scores, protected, setup.pads)
    glob = full.state.global_layers
    n, start = len(full.state), full.state.next_position
    records = []
    for q, probe in enumerate(conv.probes):
        asked = [*full.messages, Message("user", probe.question)]
        ids = full.renderer.render(asked, generation_prompt=True).ids[n:]
        library = mems["auto"].ask(probe.question, max_new_tokens=setup.max_new, remember=False)
        firsts = {}
        for name, (layers, masked) in rows.items():
            setup.runner.pad_weight, setup.runner.watch = 0.0, name.endswith("_pads")
            out, firsts[name] = generate(
                setup.runner, layers, ids, start, masked, setup.max_new, setup.eos
            )
            text = setup.tok.decode(out, skip_special_tokens=True)
            cuts = [text.split(stop)[0] for stop in full.renderer.stops]
            text = min(cuts, key=len, default=text).strip()
            rec = {"id": f"{conv.id}-q{q}", "budget": fraction, "row": name, "answer": text}
            rec["correct"] = bool(best_subspan_em(text, probe.answers))
            rec["pad_weight"] = setup.runner.pad_weight if setup.runner.watch else None
            rec.update(accounting(layers, glob), budget_bytes=budget)
            if name == "default":
                rec["library_answer"] = library
                rec["library_correct"] = bool(best_subspan_em(library, probe.answers))
            records.append(rec)
        records[-1]["logit_diff_vs_default"] = float(
            (firsts["masked_pads"] - firsts["default"]).abs().max()
        )
    return records


def summarize(records: Sequence[dict]) -> tuple[list[dict], str]:
    """Per budget and row: questions right (and the library's ``Memory.ask`` on ``default``),
    the largest pad weight and logit difference, slots against entries; and the table."""
    out, cells = [], []
    for fraction in sorted({r["budget"] for r in records}, reverse=True):
        for name in ROWS:
            rs = [r for r in records if r["budget"] == fraction and r["row"] == name]
            if not rs:
                continue
            got = {"budget": fraction, "row": name, "correct": sum(r["correct"] for r in rs)}
            got["library_correct"] = sum(r.get("library_correct", 0) for r in rs)
            got["slot_ratio"] = sum(r["vllm_slots"] for r in rs) / sum(r["entries"] for r in rs)
            got["vllm_bytes_over_budget"] = sum(r["vllm_bytes"] for r in rs) / sum(
                r["budget_bytes"] for r in rs
            )
            for key, field in (
                ("max_pad_weight", "pad_weight"),
                ("max_logit_diff", "logit_diff_vs_default"),
            ):
                vals = [r[field] for r in rs if r.get(field) is not None]
                got[key] = max(vals) if vals else None
            out.append(got | {"questions": len(rs)})
            lib = f"{got['library_correct']}" if name == "default" else "-"
            extra = [f"{got[k]:.2g}" if got[k] is not None else "-" for k in list(got)[-2:]]
            ratios = [f"{got['slot_ratio']:.2f}", f"{got['vllm_bytes_over_budget']:.2f}"]
            cells.append([f"{fraction:g}", name, f"{got['correct']}/{len(rs)}", lib, *ratios])
            cells[-1] += extra
    head = ["budget", "row", "right", "Memory.ask right", "vLLM slots / entries"]
    head += ["vLLM bytes / budget", "max pad weight", "max logit diff vs default"]
    return out, "\n".join(markdown_table(head, cells))


def run_conversation(setup: Setup, conv, budgets: Sequence[float]) -> list[dict]:
    """Records of one conversation at every budget."""
    import kvedit
    from kvedit.compress.scorers import Learned

    full = kvedit.Memory(setup.model, setup.tok)
    for role, content in conv.messages:
        full.add(role, content)
    scores = Learned().score(full.state, list(full.state.global_layers))
    protected = protected_tokens(full, len(full.state))
    return [r for f in budgets for r in run_budget(setup, conv, full, scores, protected, f)]


def check_budgets(text: str) -> list[float]:
    """``--budgets`` as fractions in (0, 1], refused before any work."""
    try:
        got = [float(b) for b in text.split(",") if b.strip()]
    except ValueError as e:
        raise InvalidInputError(f"--budgets must be fractions like 0.25,0.1: {e}") from e
    if not got or any(not 0 < b <= 1 for b in got):
        raise InvalidInputError(f"--budgets must be fractions in (0, 1], not {text!r}")
    return got


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--n-examples", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--messages", type=int, default=60)
    ap.add_argument("--facts", type=int, default=9)
    ap.add_argument("--budgets", default="0.25,0.1", help="fractions of the bytes")
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--calibration-seed", type=int, default=1001, help="the pads' conversation")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", default=str(RUNS / "memory_serve_pads.json"))
    ap.add_argument("--resume", action="store_true", help="keep --out's whole conversations")
    args = ap.parse_args(argv)
    budgets = check_budgets(args.budgets)
    if args.threads:
        torch.set_num_threads(args.threads)
    import kvedit
    from kvedit.evals.tasks.memory_facts import facts_examples
    from kvedit.memory.rendering import Message

    convs = facts_examples(args.n_examples, args.seed, args.messages, args.facts)
    model, tok = kvedit.load_model(args.model)
    runner = Runner(model)
    calib = facts_examples(1, args.calibration_seed, args.messages, args.facts)[0]
    cmem = kvedit.Memory(model, tok)
    pads = calibrate(runner, cmem.renderer.render([Message(r, c) for r, c in calib.messages]).ids)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) | {tok.eos_token_id}
    setup = Setup(model, tok, runner, pads, eos, args.answer_tokens)
    records, done = [], set()
    if args.resume and Path(args.out).exists():
        records = json.loads(Path(args.out).read_text())["records"]
        done = {r["id"].rsplit("-q", 1)[0] for r in records}
    payload = {"model": args.model, "command": sys.argv}
    payload["pad_least_alignment"] = {str(i): least for i, (_, least) in pads.items()}
    for conv in convs:
        if conv.id in done:
            continue
        t0 = time.perf_counter()
        records += run_conversation(setup, conv, budgets)
        summary = summarize(records)[0]  # written after each conversation
        write_json(args.out, {**payload, "summary": summary, "records": records})
        print(f"{conv.id}: {time.perf_counter() - t0:.0f} s", flush=True)
    print(summarize(records)[1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
