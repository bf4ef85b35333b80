import sys

from memops_sandbox import cli

sys.exit(cli.main())
