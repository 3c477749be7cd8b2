"""`python -m launch ...` is the same as `ppring ...`."""

import sys

from launch.cli import main

sys.exit(main())
