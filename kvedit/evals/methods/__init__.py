"""Methods of the lost-in-the-middle suite: one method per module, in a registry.

A method turns one example into a prediction. It gets an
:class:`~kvedit.evals.methods.context.ExampleContext`, which builds the chat-templated prompt,
captures the cache of the documents once (shared by every method on that example) and knows
where each document sits in the captured text. Methods are named by spec strings, ``name`` or
``name:key=value[:key=value]`` (``auto:target=0.3``); the spec is the method's key in
``results.json``, and each method's parameters are a typed, checked dataclass
(:mod:`~kvedit.evals.methods.params`).

======================  ================================================================
``none``                the captured cache as is (:mod:`.none`)
``closedbook``          no documents (:mod:`.closedbook`)
``gold_only``           only the gold document (:mod:`.gold_only`)
``repeat``              the question also asked before the documents (:mod:`.repeat`)
``oracle``              the gold document edited (:mod:`.oracle`, :class:`.EditParams`)
``auto``                the documents the question points at emphasized (:mod:`.auto`)
``reread``              those documents re-read at the end of the cache (:mod:`.reread`)
``blend``               documents cached behind the instruction, then blended (:mod:`.blend`)
``snapkv``              the cache compressed by SnapKV (:mod:`.snapkv`)
``quantize``            the cache quantized (:mod:`.quantize`)
``select``              the cache compressed by any scorer (:mod:`.select`)
``minicache``           adjacent deep layers merged pairwise, optionally quantized (:mod:`.minicache`)
======================  ================================================================

Add a method: a new module here, imported below, with::

    @dataclass(frozen=True)
    class MineParams:
        strength: float = 1.0

    @register_method("mine")
    class Mine(Method):
        Params = MineParams

        def predict(self, ctx):
            return ctx.state.generate(ctx.continuation, ctx.max_new_tokens)
"""

from __future__ import annotations

from kvedit.evals.methods.auto import Auto, AutoParams, auto_hit_rate
from kvedit.evals.methods.blend import Blend, BlendParams, document_parts
from kvedit.evals.methods.closedbook import ClosedBook
from kvedit.evals.methods.context import ExampleContext, split_prompt
from kvedit.evals.methods.edits import EDITS, EditParams, apply_edit
from kvedit.evals.methods.focus import example_focus
from kvedit.evals.methods.gold_only import GoldOnly
from kvedit.evals.methods.minicache import MiniCache, MiniCacheParams
from kvedit.evals.methods.none import NoEdit
from kvedit.evals.methods.oracle import Oracle
from kvedit.evals.methods.params import NoParams
from kvedit.evals.methods.quantize import Quantize, QuantizeParams
from kvedit.evals.methods.registry import (
    METHODS,
    Method,
    parse_spec,
    register_method,
    split_specs,
)
from kvedit.evals.methods.repeat import RepeatQuestion
from kvedit.evals.methods.reread import Reread, RereadParams
from kvedit.evals.methods.select import Select, SelectParams
from kvedit.evals.methods.snapkv import SnapKV, SnapKVParams

__all__ = [
    "EDITS",
    "METHODS",
    "Auto",
    "AutoParams",
    "Blend",
    "BlendParams",
    "ClosedBook",
    "EditParams",
    "ExampleContext",
    "GoldOnly",
    "Method",
    "MiniCache",
    "MiniCacheParams",
    "NoEdit",
    "NoParams",
    "Oracle",
    "Quantize",
    "QuantizeParams",
    "RepeatQuestion",
    "Reread",
    "RereadParams",
    "Select",
    "SelectParams",
    "SnapKV",
    "SnapKVParams",
    "apply_edit",
    "auto_hit_rate",
    "document_parts",
    "example_focus",
    "parse_spec",
    "register_method",
    "split_prompt",
    "split_specs",
]
