"""kvedit's bridges to other inference engines.

============  ===========================================================================
``vllm``      :mod:`kvedit.integrations.vllm`: publish a (possibly edited) state for vLLM,
              and a vLLM engine whose KV connector serves it (extra ``kvedit[vllm]``)
============  ===========================================================================

``import kvedit`` imports the bridges (so ``kvedit.integrations.vllm.publish`` resolves), never
their engines: each bridge imports its engine only where it needs it, so the parts that only
write files work without the engine installed.
"""

from __future__ import annotations

from . import vllm

__all__ = ["vllm"]
