"""python -m trainer ... == rolloutstore-train ..."""

import sys

from .cli import main

sys.exit(main())
