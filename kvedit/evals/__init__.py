"""Evaluation suites: lost-in-the-middle (``kvedit eval litm``: tasks, methods by name, the
transformers and vLLM engines, metrics, reports), the memory suite (``kvedit eval memory``),
the projection suite (``kvedit eval project``), and fitting the learned forgetting scorer
(``kvedit memory fit-scorer``)."""
