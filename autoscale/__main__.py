import sys

from autoscale.cli import main

sys.exit(main())
