"""`python -m voltserve ARGS`: the `voltserve` command (`voltserve.console.main`: SIGINT and SIGTERM noted before
its imports), e.g. where the console script is not on PATH."""

import sys

from voltserve.console import main

sys.exit(main())
