"""``python -m hybrid.testbed``: the testbed from the shell, e.g. a real Slurm cluster (:mod:`hybrid.tools.testbed_cli`)."""

import sys

from hybrid.tools.testbed_cli import main

if __name__ == "__main__":
    sys.exit(main())
