import sys

from stepguard.soak.runner import main

sys.exit(main())
