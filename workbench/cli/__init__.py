"""The `varlen-workbench` command line: `main` parses and dispatches, `audit_command` is the audit's
subcommand, `scaffold` starts a new post-mortem from the templates under cli/templates/.
"""

EXIT_FAILED, EXIT_USAGE = 1, 2  # a claim does not hold or the build failed; bad usage or input
