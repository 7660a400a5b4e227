"""``python -m hybrid.report``: the report of a sweep's runs (:mod:`hybrid.tools.report`)."""

import sys

from hybrid.tools.report import main

if __name__ == "__main__":
    sys.exit(main())
