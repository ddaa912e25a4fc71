"""``python -m pinads_rec.data.build --config X.yaml --raw RAW_DIR --out DIR`` (the command line is
cli.py)."""

import sys

from pinads_rec.data.build.cli import main

sys.exit(main())
