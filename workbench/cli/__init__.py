"""The `varlen-workbench` command line: `main` parses and dispatches, `scaffold` starts a new
post-mortem from the templates under cli/templates/.
"""
