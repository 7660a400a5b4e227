"""``python -m hybrid.bench``: benchmarks of the collectives and of training (:mod:`hybrid.tools.bench`)."""

import sys

from hybrid.tools.bench import main

if __name__ == "__main__":
    sys.exit(main())
