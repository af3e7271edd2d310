"""The results and reproduce()."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from varlen_workbench.kernels.varlen import varlen_attention_triton
from varlen_workbench.postmortems.te_thd_2892.cases import CASES, FP8_CASE, HEALTH_FRACTIONS, RECIPE_SEQLENS
from varlen_workbench.postmortems.te_thd_2892.mechanism import (
    RecipeResult,
    RopeStudy,
    _quantized,
    auto_detect,
    cast_study,
    contract_error,
    fp8_study,
    layout_contract,
    rope_study,
    seqpar_study,
    te_recipe,
    workaround_error,
    workaround_sweep,
)
from varlen_workbench.postmortems.te_thd_2892.training import SeedRun, bidirectional_seeds, health_runs, train_three_ways
from varlen_workbench.workbench.audit.context_parallel import PaddingRuleStudy, padding_rule_study
from varlen_workbench.workbench.bounds import ErrorCheck
from varlen_workbench.workbench.instruments.health import GradientHealth
from varlen_workbench.workbench.instruments.seqpar import SeqParStudy
from varlen_workbench.workbench.instruments.tinylm import (
    TrainingRun,
    dense_attention,
)
from varlen_workbench.workbench.layout import Case, Fill, pack
from varlen_workbench.workbench.postmortem import Results
from varlen_workbench.workbench.probes import ProbeRecord


@dataclass
class TeResults(Results):
    """Everything `reproduce()` measured."""

    layout: ProbeRecord  # our kernel on TE's docstring layout
    recipe: RecipeResult  # TE's THD padding test applied to our kernel
    workaround_kernel: dict[bool, ErrorCheck]  # causal -> our kernel called the VERL way
    contract: dict[bool, ErrorCheck]  # causal -> the replica called the right way
    workaround_sweep: dict[bool, list[tuple[float, ErrorCheck]]]
    training: dict[str, tuple[TrainingRun, GradientHealth]]
    seeds: tuple[SeedRun, ...]
    health: dict[str, GradientHealth]  # the explorer's opening frame
    auto_detect: dict[str, tuple[bool, bool]]
    fp8: dict[tuple[str, str], ErrorCheck]
    fp8_zero_scales_equal: bool  # zero padding: scales over all rows == scales over real rows
    cast: dict
    seqpar: SeqParStudy
    cp_rule: PaddingRuleStudy  # the 2 x cp_size padding rule, kept and broken, on our context-parallel attention
    rope: RopeStudy


def fp8_zero_padding_scales_equal(case: Case = FP8_CASE, device=None) -> bool:
    """With padding rows zeroed, block scales over every row equal those over real rows (and so do the codes)."""
    batch = pack(case.with_(fill=Fill.ZEROS), device, requires_grad=False)
    real, every = _quantized(batch, "real"), _quantized(batch, "all")
    return all(torch.equal(a.scale, b.scale) and torch.equal(a.data.float(), b.data.float()) for a, b in zip(real, every))


def reproduce(device=None) -> TeResults:
    """Every part of the study. The fixed and FP8 Triton kernels run on one small case each;
    sweeps and training use `dense_attention` (the same contract, tested against the oracle)."""
    with warnings.catch_warnings():
        # numpy inside the interpreter, on the NaN-poisoned blocks the FP8 study poisons on purpose
        warnings.filterwarnings("ignore", "All-NaN slice", RuntimeWarning)
        fp8 = fp8_study(device=device)
    return TeResults(
        layout=layout_contract(device=device),
        recipe=te_recipe(varlen_attention_triton, RECIPE_SEQLENS, device=device),
        workaround_kernel={
            causal: workaround_error(CASES[1 + causal], varlen_attention_triton, device) for causal in (False, True)
        },
        contract={causal: contract_error(CASES[1 + causal]) for causal in (False, True)},
        workaround_sweep=workaround_sweep(dense_attention),
        training=train_three_ways(),
        seeds=bidirectional_seeds(),
        health=health_runs(HEALTH_FRACTIONS[0]),
        auto_detect=auto_detect(),
        fp8=fp8,
        fp8_zero_scales_equal=fp8_zero_padding_scales_equal(device=device),
        cast=cast_study(device),
        seqpar=seqpar_study(device),
        # gloo ranks on the CPU on any machine: the rule is about the layout, not the device
        cp_rule=padding_rule_study(on_cpu=True),
        rope=rope_study(device=device),
    )
