"""``python -m stepguard.launch``: runs the stepguard-launch command."""

import sys

from stepguard.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
