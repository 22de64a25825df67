"""``python -m apps.highlight`` (in a checkout) or ``python -m kvedit_apps.highlight``."""

from .ui import main

raise SystemExit(main())
