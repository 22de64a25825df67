"""Probe for the next step of ``blend``: cache each passage behind the instruction prefix.

``kvedit.blend`` caches every part after the first on its own, at positions ``0..n-1``, so each
passage starts as its own attention sink and its tokens never saw the instruction. This probe
compares, on NQ examples of ``kvedit eval litm``, at ``recompute=0.15``:

* ``none``: the full prefill;
* ``alone``: ``kvedit.blend`` as it is;
* ``behind``: the same blend, but each passage cached right after the blend's first part (the
  chat template and instruction, shared by every prompt), its entries then moved like any part.

It is a probe, not an API: the ``behind`` caches are edited states (positions do not start at
0), which ``KVStore`` refuses by design, so it swaps blend's passage capture for the run and
keeps nothing. A real version would key stored passages by (prefix, passage)::

    python benchmarks/blend_context_probe.py --seed 1 --limit 30
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile

import kvedit.blend  # noqa: F401  (the module, reached through sys.modules below)
from kvedit.evals.litm import build_examples
from kvedit.evals.methods import ExampleContext, document_parts
from kvedit.evals.schema import score
from kvedit.models import load_model
from kvedit.reuse import encode, extend_ids
from kvedit.state import KVState, capture
from kvedit.store import KVStore

blend_module = sys.modules["kvedit.blend"]  # `kvedit.blend` the attribute is the function


class _Scratch(KVStore):
    """A store that serves nothing it did not hold and keeps nothing (probe caches are edited)."""

    def put(self, state, ttl=None):
        return "probe"


def capture_behind(prefix: KVState):
    """A replacement for blend's passage capture: the passage run on top of ``prefix``, then cut
    out (token indices from 0, rotary positions left where they were computed)."""

    def capture_passage(model, tokenizer, text: str) -> KVState:
        ids, offsets = encode(tokenizer, text, special_tokens=False)
        full = extend_ids(prefix, ids, offsets, prefix.text + text)
        n0 = len(prefix)
        layers = []
        for layer in full.layers:
            part = layer.select((layer.token_index >= n0).nonzero().flatten())
            layers.append(dataclasses.replace(part, token_index=part.token_index - n0))
        return full.replace(
            layers=layers,
            token_ids=full.token_ids[n0:],
            offsets=full.offsets[n0:] - len(prefix.text),
            text=text,
            position_ids=full.position_ids[n0:],
        )

    return capture_passage


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--limit", type=int, default=30, help="examples (positions interleaved)")
    p.add_argument("--recompute", type=float, default=0.15)
    args = p.parse_args()
    model, tokenizer = load_model(args.model)
    alone = blend_module.capture_passage
    correct = {"none": 0, "alone": 0, "behind": 0}
    examples = build_examples("nq", None, None, None, 100, args.seed, args.limit)
    for example in examples:
        ctx = ExampleContext(model, tokenizer, example)
        parts = document_parts(ctx)
        correct["none"] += score(example, ctx.state.generate(ctx.continuation, 32))
        for name, passage_capture in (
            ("alone", alone),
            ("behind", capture_behind(capture(model, tokenizer, parts[0]))),
        ):
            blend_module.capture_passage = passage_capture
            try:
                with tempfile.TemporaryDirectory() as root:
                    state, _ = blend_module.blend(
                        model, tokenizer, parts, _Scratch(root), recompute=args.recompute
                    )
            finally:
                blend_module.capture_passage = alone
            correct[name] += score(example, state.generate(ctx.continuation, 32))
        print(example.id, correct, flush=True)
    n = len(examples)
    print(" ".join(f"{k} {v / n:.3f}" for k, v in correct.items()), f"({n} examples)")


if __name__ == "__main__":
    main()
