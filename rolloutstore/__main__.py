import sys

from rolloutstore.cli import main

sys.exit(main())
