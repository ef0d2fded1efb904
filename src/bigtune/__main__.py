import sys

from bigtune.cli.app import main

sys.exit(main())
