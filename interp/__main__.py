"""``python -m interp`` is the ``interp`` command."""

import sys

from interp.cli.main import main

sys.exit(main())
