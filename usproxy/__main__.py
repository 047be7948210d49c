"""`python -m usproxy` runs the CLI."""

import sys

from usproxy.cli import main

sys.exit(main())
