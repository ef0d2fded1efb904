import sys

from bigtune.cli.main import main

sys.exit(main())
