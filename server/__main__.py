"""`python -m server [options]`: the same as `specloop serve [options]`."""

import sys

from specloop.cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
