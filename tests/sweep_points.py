"""Module-level sweep functions: spawned worker processes import them from here."""

import os


def divide(numerator, denominator):
    return {"quotient": numerator / denominator, "pid": os.getpid()}


def crash(code):
    if code:
        os._exit(code)  # the worker process dies without a Python exception
    return {"value": code}
