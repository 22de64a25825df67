"""What decoding two answers of one prompt as one batch would cost, against decoding them one
after the other: the unedited state and its emphasized edit, on kvedit's own forward.

Focus's guard (:class:`kvedit.focusing.guard.SupportGuard`) decodes the unedited answer and,
where the edit answers, the edited one: two question passes and two decodes in turn. An edit by
:func:`kvedit.ops.emphasize` keeps the entries (a bias on them, and the last input recomputed),
so both could run as one batch of two over the same cache: row 0 without the bias, row 1 with
it. This benchmark times each part both ways on one prompt:

- ``question``: the continuation run over the cache (batch 1, and batch 2);
- ``step``: one greedy decode step (batch 1, and batch 2), the median of ``--steps``.

``*_pair_over_two`` is the batch-of-two time over twice the batch-1 time: below 1, the batch
saves that share of the two sequential runs; 0.5 would make the second answer free. Row by row,
the batch computes what the single runs compute (``max_logit_gap``: the largest difference of a
logit between the batch's rows and the single runs over the question and every step; rounding
only, as a batch of two may take other kernels; ``edit_logit_gap``, the largest difference the
edit makes to the first answer token's logits, is what a mixed-up row would show).

The model is the bundled one on an NQ-10 prompt (``--task``), or ``--shape`` a random-weight
model of a real shape (:func:`benchmarks.gpu_e2e.model_configs`) on ``--tokens`` random words,
for a GPU without weights.

    python -m benchmarks.decode_pair --out runs/decode_pair_cpu.json
    python -m benchmarks.decode_pair --shape llama3-8b --tokens 4096 --out runs/decode_pair_gpu.json
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Sequence
from functools import partial

import torch

from benchmarks.common import add_model, parser, write_json
from benchmarks.gpu_e2e import timed
from kvedit import ops
from kvedit.cache import LayerKV
from kvedit.cache.adapter import dynamic_cache
from kvedit.runtime import forward
from kvedit.states.decoding import Decoder
from kvedit.states.passes import StateBias
from kvedit.states.state import KVState

STRENGTH = 2.0
"""The emphasis of the benchmark's edit (nats); the cost does not depend on it."""


def pair_layer(plain: LayerKV, edited: LayerKV) -> LayerKV:
    """One layer of a batch of two: ``plain``'s entries as row 0, ``edited``'s as row 1
    (``[2, kv_heads, n, head_dim]``), each row its own bias (zeros where a state has none)."""
    if len(plain) != len(edited) or plain.packed or edited.packed:
        raise ValueError("a batch of two needs dense layers of the same length")
    bias = None
    if plain.bias is not None or edited.bias is not None:
        heads = max(x.bias.shape[1] for x in (plain, edited) if x.bias is not None)
        bias = torch.cat([plain.dense_bias(heads), edited.dense_bias(heads)])
    return dataclasses.replace(
        edited,
        keys=torch.cat([plain.keys, edited.keys]),
        values=torch.cat([plain.values, edited.values]),
        bias=bias,
    )


@torch.no_grad()
def measure(plain: KVState, edited: KVState, continuation: str, steps: int) -> dict:
    """Question pass and decode steps, one state at a time and the two as one batch."""
    device, kind = plain.device, plain.device.type  # timed() waits for CUDA's work to end
    ids = plain.encode(continuation, reserve=steps)
    singles, logits = [], []
    for state in (plain, edited):
        question, dec = timed(partial(Decoder, state, continuation), kind)
        step_times, rows = [], [dec.next_logits.float()]
        for _ in range(steps):
            token = int(rows[-1].argmax())
            seconds, out = timed(partial(dec.push, token), kind)
            step_times.append(seconds)
            rows.append(out.float())
        singles.append((question, statistics.median(step_times)))
        logits.append(torch.stack(rows))

    model, _ = plain.require_model()
    layers = [pair_layer(a, b) for a, b in zip(plain.layers, edited.layers, strict=True)]
    cache, plan = dynamic_cache(layers), StateBias(layers)
    position = plain.next_position
    question, out = timed(
        lambda: forward(
            model,
            torch.tensor([ids, ids], device=device),
            torch.arange(position, position + len(ids), device=device).expand(2, -1),
            cache,
            plan=plan,
            logits_to_keep=1,
        ),
        kind,
    )
    position += len(ids)
    step_times, rows = [], [out[:, -1].float()]
    for k in range(steps):
        # each row is fed its own single run's token, so both runs see the same inputs
        tokens = torch.stack([logits[r][k].argmax() for r in (0, 1)]).view(2, 1)
        where = torch.full((2, 1), position + k, device=device)
        seconds, out = timed(partial(forward, model, tokens, where, cache, plan=plan), kind)
        step_times.append(seconds)
        rows.append(out[:, -1].float())
    pair = torch.stack(rows, dim=1)  # [2, steps + 1, vocab]
    gap = max(float((pair[r] - logits[r]).abs().max()) for r in (0, 1))
    edit_gap = float((logits[0][0] - logits[1][0]).abs().max())
    one_q, one_step = (singles[0][0] + singles[1][0]) / 2, (singles[0][1] + singles[1][1]) / 2
    two_step = statistics.median(step_times)
    return {
        "cache_entries": plain.cache_length,
        "question_tokens": len(ids),
        "question_single_s": one_q,
        "question_pair_s": question,
        "question_pair_over_two": question / (2 * one_q),
        "step_single_s": one_step,
        "step_pair_s": two_step,
        "step_pair_over_two": two_step / (2 * one_step),
        "max_logit_gap": gap,
        "edit_logit_gap": edit_gap,
    }


def bundled_prompt(model_name: str, task: str, seed: int):
    """The bundled (or named) model's captured state of one eval prompt, its middle document
    emphasized, and the question's continuation."""
    from kvedit.evals.litm import build_examples
    from kvedit.evals.methods import ExampleContext
    from kvedit.models import load_model

    model, tok = load_model(model_name)
    (example,) = build_examples(task, None, None, None, None, seed, 1)
    ctx = ExampleContext(model, tok, example, 1)
    spans = ctx.doc_spans
    return ctx.state, ops.emphasize(ctx.state, [spans[len(spans) // 2]], STRENGTH), ctx.continuation


def shaped_prompt(shape: str, tokens: int, seed: int):
    """A random-weight model of ``shape`` (bf16 on CUDA, float32 on CPU), ``tokens`` random
    words captured, a span in their middle emphasized, and a short continuation."""
    import kvedit
    from benchmarks.gpu_e2e import build_model, make_prompt, model_configs
    from kvedit.testing import tiny_tokenizer

    configs = model_configs(tiny=shape.startswith("tiny-"))
    cuda = torch.cuda.is_available()
    model = build_model(
        configs[shape.removeprefix("tiny-")],
        "cuda" if cuda else "cpu",
        torch.bfloat16 if cuda else torch.float32,
    )
    tok = tiny_tokenizer()
    text, span = make_prompt(tok, tokens, seed)
    state = kvedit.capture(model, tok, text)
    return state, ops.emphasize(state, span, STRENGTH), " and then what"


def main(argv: Sequence[str] | None = None) -> int:
    p = parser(__doc__)
    add_model(p)
    p.add_argument("--task", default="nq", help="the eval task of the prompt (bundled model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape", default=None, help="llama3-8b or gemma3-4b (random weights)")
    p.add_argument("--tokens", type=int, default=4096, help="prompt tokens with --shape")
    p.add_argument("--steps", type=int, default=24, help="decode steps timed")
    p.add_argument("--repeats", type=int, default=3, help="runs; the last is reported")
    p.add_argument("--out", default=None, help="write the times here (JSON)")
    args = p.parse_args(argv)
    if args.shape is None:
        plain, edited, continuation = bundled_prompt(args.model, args.task, args.seed)
    else:
        plain, edited, continuation = shaped_prompt(args.shape, args.tokens, args.seed)
    for _ in range(args.repeats):  # the first runs warm the kernels and the allocator up
        result = measure(plain, edited, continuation, args.steps)
    result = {
        "model": args.shape or args.model,
        "device": str(plain.device),
        "threads": torch.get_num_threads(),
        **result,
    }
    write_json(args.out, result, indent=1)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
