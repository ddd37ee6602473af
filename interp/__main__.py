"""``python -m interp`` is the ``interp`` command."""

import sys

from interp.cli import main

sys.exit(main())
