"""``python -m ferrodist.launch run -n N script.py``."""

import sys

from ._cli import main

sys.exit(main())
