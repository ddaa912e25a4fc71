"""``python -m pinads_rec.data.inspect --config X.yaml | --data DIR --draft-config OUT.yaml``
(the command line is cli.py)."""

import sys

from pinads_rec.data.inspect.cli import main

sys.exit(main())
