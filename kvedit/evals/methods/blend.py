"""``blend``: every document cached behind the instruction, then blended.

``blend`` (``blend:recompute=0.15,context=prefix``): each document is cached as it reads right
after the prompt's instruction prefix, in a store (one temporary store per method object, so
documents shared by examples with the same prefix are computed once), then the documents are
blended after the prefix with :func:`kvedit.blend`, which recomputes that fraction of the
tokens; the question follows as usual. ``context=alone`` caches each document on its own
instead (the blend of earlier reports). The rules of :mod:`kvedit.reusing.blend_rules` are parameters
too, off unless given: ``blend:recompute=0.15:gradual=2``, ``blend:recompute=0:leading=4``,
``blend:rescale=0.8``; a spec records them only when given.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import Any

from kvedit.evals.methods.context import ExampleContext
from kvedit.evals.methods.params import check_choice, check_fraction
from kvedit.evals.methods.registry import Method, register_method
from kvedit.reusing.blend_rules import BLEND_RULES, BlendRules
from kvedit.reusing.blending import BLEND_CONTEXTS, blend
from kvedit.store import KVStore

__all__ = [
    "BLEND_STORE_DISK_BYTES",
    "BLEND_STORE_MEMORY_BYTES",
    "Blend",
    "BlendParams",
    "document_parts",
]

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


@dataclass(frozen=True)
class BlendParams:
    """The parameters of ``blend``.

    Attributes:
        recompute: The fraction of the tokens :func:`kvedit.blend` recomputes, in ``[0, 1]``.
        context: What each document is cached after: ``"prefix"`` (the instruction prefix)
            or ``"alone"`` (nothing); see :data:`kvedit.reusing.blending.BLEND_CONTEXTS`.
        gradual, leading, rescale: the blend rules (:mod:`kvedit.reusing.blend_rules`); None: off.
    """

    recompute: float = 0.15
    context: str = "prefix"
    gradual: float | None = None
    leading: int | None = None
    rescale: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", check_fraction("recompute", self.recompute))
        check_choice("context", self.context, BLEND_CONTEXTS)
        self.rules()  # refuses bad values

    def rules(self) -> dict[str, Any]:
        """The rules that are on, as :func:`kvedit.blend` keywords (checked)."""
        values = {k: getattr(self, k) for k in BLEND_RULES if getattr(self, k) is not None}
        BlendRules.from_values(**values)
        return values


@register_method("blend")
class Blend(Method):
    """Documents cached alone, blended after the instruction with selective recompute.

    Leaves ``ctx.notes["blend_report"]`` (where each part came from).
    """

    uses_capture = False

    Params = BlendParams
    needs_documents = True

    def __init__(self, params: BlendParams | None = None, /, **values: float) -> None:
        super().__init__(params, **values)
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._kvstore: KVStore | None = None

    def param_dict(self) -> dict[str, Any]:
        """The parameters, rules only when on: a spec without rules records what it always
        did, so runs recorded before the rules existed still resume."""
        out = super().param_dict()
        return {k: v for k, v in out.items() if k not in BLEND_RULES or v is not None}

    def _store(self) -> KVStore:
        if self._kvstore is None:
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
            recompute=float(self.params.recompute),
            context=self.params.context,
            **self.params.rules(),
        )
        ctx.notes["blend_report"] = report
        return state.generate(ctx.continuation, ctx.max_new_tokens)
