"""``python -m pinads_rec.serve score|export|export-ads ...`` (the command line is cli.py)."""

import sys

from pinads_rec.serve.cli import main

sys.exit(main())
