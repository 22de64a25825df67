"""``kvedit app``: the Gradio highlight app."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from ..errors import (
    KVEditError,
)

# The highlight app's source is apps/highlight/ in the repository. The wheel installs apps/ as
# the package kvedit_apps (pyproject.toml: package-dir); a checkout has it next to kvedit/.
_APP_MODULE = "kvedit_apps.highlight"


_CHECKOUT_APPS = Path(__file__).resolve().parents[2] / "apps"


def load_app() -> ModuleType:
    """The highlight app: the installed ``kvedit_apps.highlight``, else ``apps/`` of this checkout.

    From a checkout (kvedit imported from the repository, the app not installed) the ``apps/``
    folder next to ``kvedit/`` is imported under the installed name, ``kvedit_apps``.
    """
    try:
        return importlib.import_module(_APP_MODULE)
    except ModuleNotFoundError as e:
        if e.name not in ("kvedit_apps", _APP_MODULE):
            raise  # a dependency of the app is missing
    init = _CHECKOUT_APPS / "__init__.py"
    if not (init.is_file() and (_CHECKOUT_APPS / "highlight" / "__init__.py").is_file()):
        raise KVEditError(
            f"neither {_APP_MODULE} (installed with kvedit) nor {_CHECKOUT_APPS} "
            "(a kvedit checkout) was found; reinstall kvedit: pip install 'kvedit[app]'"
        )
    spec = importlib.util.spec_from_file_location(
        "kvedit_apps", init, submodule_search_locations=[str(_CHECKOUT_APPS)]
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = package
    spec.loader.exec_module(package)
    return importlib.import_module(_APP_MODULE)


def run_app(args) -> int:
    try:
        import gradio  # noqa: F401
    except ModuleNotFoundError:
        raise KVEditError(
            "kvedit app needs Gradio: pip install 'kvedit[app]' (in a checkout: make setup)"
        ) from None
    load_app().serve(args.model, args.host, args.port)
    return 0
