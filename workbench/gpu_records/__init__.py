"""The GPU records under data/gpu/: what each measured and the command that remakes it
(`kinds`), a fingerprint of the measured code (`fingerprint`), whether a record still describes
the code that ships (`freshness`), and the plan of calls that remakes the stale ones (`plan`).
"""
