"""Apps built on kvedit. ``apps.highlight`` is the Gradio highlight app (``kvedit app``)."""
