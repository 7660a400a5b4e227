"""``python -m hybrid.costmodel``: the cost model's predictions and calibration (:mod:`hybrid.tools.costmodel`)."""

import sys

from hybrid.tools.costmodel import main

if __name__ == "__main__":
    sys.exit(main())
