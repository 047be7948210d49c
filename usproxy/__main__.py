"""`python -m usproxy` runs the CLI."""

import sys

from usproxy.app.cli import main

sys.exit(main())
