"""Recipes by TE's names and fields; Float8BlockScaling refuses fp8_dpa as TE 2.20.2 does."""

from dataclasses import dataclass


@dataclass
class DelayedScaling:
    fp8_dpa: bool = False
    fp8_mha: bool = False


@dataclass
class Float8CurrentScaling:
    fp8_dpa: bool = False
    fp8_mha: bool = False


@dataclass
class Float8BlockScaling:
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        assert not self.fp8_dpa and not self.fp8_mha, "FP8 attention is not supported for Float8BlockScaling."
