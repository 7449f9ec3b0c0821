"""python -m trainer ... == rolloutstore-train ..."""

import sys

from trainer.cli import main

sys.exit(main())
