"""``python -m pinads_rec.reference --config X`` (the command line is cli.py)."""

import sys

from pinads_rec.reference.cli import main

sys.exit(main())
