"""`python -m varlen_workbench.workbench ...` is the `workbench` command."""

import sys

from varlen_workbench.workbench.cli.main import main

sys.exit(main())
