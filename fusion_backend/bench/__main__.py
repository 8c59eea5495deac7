"""``python -m fusion_backend.bench`` runs the same command as ``python -m fusion_backend bench``."""

import sys

from .cli import main

sys.exit(main())
