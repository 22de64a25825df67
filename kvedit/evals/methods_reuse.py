"""Lost-in-the-middle methods of the reuse layer: ``blend``, ``snapkv`` and ``quantize``.

They register themselves in :data:`kvedit.evals.methods.METHODS` when this module is imported
(``kvedit.evals.methods`` imports it at its end).

* ``blend:recompute=0.15``: every document is cached on its own in a store (one temporary
  store per method object, so documents shared by examples are computed once), then blended
  after the instruction prefix with :func:`kvedit.blend`; the question follows as usual.
* ``snapkv:keep=0.5``: the captured documents compressed with :func:`kvedit.ops.snapkv`,
  scored by the question (the continuation text: question and chat template, the tokens that
  come next), or by the documents' last ``window`` tokens with ``observe='window'``.
* ``quantize:bits=8``: the captured documents quantized with :func:`kvedit.ops.quantize`.
"""

from __future__ import annotations

import tempfile

from .. import ops
from ..blend import blend
from ..store import KVStore
from .methods import ExampleContext, Method, register_method

# Budget of each blend method's temporary store: documents are reused across examples while
# they fit, least recently used ones are evicted beyond.
BLEND_STORE_DISK_BYTES = 2 * 2**30
BLEND_STORE_MEMORY_BYTES = 512 * 2**20


def document_parts(ctx: ExampleContext) -> list[str]:
    """The example's prefix cut into blend parts: instruction, then one part per document.

    Part 0 runs from the start of the prompt (chat template and instruction) to the first
    document; each document part holds the document and the separator after it, so the parts
    join to exactly :attr:`ExampleContext.prefix`.
    """
    prefix, spans = ctx.prefix, ctx.doc_spans
    if not spans:
        return [prefix]
    starts = [a for a, _ in spans] + [len(prefix)]
    parts = [prefix[: starts[0]]] + [prefix[a:b] for a, b in zip(starts, starts[1:])]
    return [p for p in parts if p]


@register_method("blend")
class Blend(Method):
    """Documents cached alone, blended after the instruction with selective recompute."""

    defaults = {"recompute": 0.15}
    needs_documents = True

    def _store(self) -> KVStore:
        if getattr(self, "_kvstore", None) is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvedit-blend-")
            self._kvstore = KVStore(
                self._tmp.name,
                max_bytes=BLEND_STORE_DISK_BYTES,
                memory_bytes=BLEND_STORE_MEMORY_BYTES,
            )
        return self._kvstore

    def predict(self, ctx: ExampleContext) -> str:
        state, report = blend(
            ctx.model,
            ctx.tokenizer,
            document_parts(ctx),
            self._store(),
            recompute=float(self.params["recompute"]),
        )
        ctx._cache["blend_report"] = report
        return state.generate(ctx.continuation, ctx.max_new_tokens)


@register_method("snapkv")
class SnapKV(Method):
    """The documents' cache compressed by SnapKV, scored by the question."""

    defaults = {"keep": 0.5, "window": 32, "kernel": 5, "observe": "question"}

    def predict(self, ctx: ExampleContext) -> str:
        observe = self.params["observe"]
        if observe not in ("question", "window"):
            raise ValueError(f"snapkv: observe must be 'question' or 'window', not {observe!r}")
        state = ops.snapkv(
            ctx.state,
            keep=float(self.params["keep"]),
            query=ctx.continuation if observe == "question" else None,
            window=int(self.params["window"]),
            kernel=int(self.params["kernel"]),
        )
        return state.generate(ctx.continuation, ctx.max_new_tokens)


@register_method("quantize")
class Quantize(Method):
    """The documents' cache quantized KIVI-style."""

    defaults = {"bits": 8, "residual": 32, "group": 32}

    def predict(self, ctx: ExampleContext) -> str:
        state = ops.quantize(
            ctx.state,
            bits=int(self.params["bits"]),
            residual=int(self.params["residual"]),
            group=int(self.params["group"]),
        )
        return state.generate(ctx.continuation, ctx.max_new_tokens)
