"""``python -m pinads_rec.plan``: the planner's command line (cli.py)."""

import sys

from pinads_rec.plan.cli import main

sys.exit(main())
