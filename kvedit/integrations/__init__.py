"""kvedit's bridges to other inference engines.

============  ===========================================================================
``vllm``      :mod:`kvedit.integrations.vllm`: publish a (possibly edited) state for vLLM,
              and a vLLM engine whose KV connector serves it (extra ``kvedit[vllm]``)
============  ===========================================================================

Nothing here is imported by ``import kvedit``; each bridge imports its engine only where it
needs it, so the parts that only write files work without the engine installed.
"""
