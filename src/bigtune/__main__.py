import sys

from bigtune.cli import main

sys.exit(main())
