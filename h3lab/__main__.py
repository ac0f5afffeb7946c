import sys

from h3lab.cli import main

sys.exit(main())
