"""``python -m rngcoord.demo``: what ``rngcoord demo`` runs."""

import sys

from rngcoord.demo import main

sys.exit(main())
