"""``python -m pinads_rec.data.synth``: the command line (cli.py)."""

import sys

from pinads_rec.data.synth.cli import main

sys.exit(main())
