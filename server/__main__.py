"""`python -m server [options]`: the same as `specloop serve [options]`."""

import sys

from server.cli import main

sys.exit(main(["serve", *sys.argv[1:]]))
