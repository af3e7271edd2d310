"""One module per post-mortem: META, CASES, reproduce(), claims (see workbench.postmortem)."""
