"""`python -m h3d.ctl`: the same as `h3ctl`."""

import sys

from h3d.ctl.app import main

if __name__ == "__main__":
    sys.exit(main())
