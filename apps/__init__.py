"""Apps built on kvedit. ``apps.highlight`` is the Gradio highlight app (``kvedit app``).

This folder is the only copy of the apps' source. A checkout imports it as ``apps``; the wheel
installs it as ``kvedit_apps`` (``[tool.setuptools.package-dir]`` in pyproject.toml), so
``pip install "kvedit[app]"`` gives a working ``kvedit app`` without a checkout.
"""
