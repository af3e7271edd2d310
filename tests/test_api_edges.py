"""Bad values at the API's edges get errors that name the argument and list the choices."""

import pytest

from varlen_workbench.workbench.layout import Case, Fill


@pytest.mark.parametrize("head_dim", [0, -16, 2.5, True])
def test_case_rejects_a_head_dim_that_is_not_a_positive_int(head_dim):
    with pytest.raises(ValueError, match=r"Case\.head_dim = .* must be a positive int"):
        Case(seqlens_q=(4,), head_dim=head_dim)


def test_fill_lists_the_valid_fills():
    with pytest.raises(ValueError) as error:
        Fill("purple")
    message = str(error.value)
    assert message.startswith("'purple' is not a padding fill")
    assert all(repr(f.value) in message for f in Fill)
    with pytest.raises(ValueError, match="'purple' is not a padding fill; choose one of 'zeros', 'nan'"):
        Case(seqlens_q=(4,), fill="purple")
    assert Fill("nan") is Fill.NAN and Case(seqlens_q=(4,), fill="+inf").fill is Fill.POS_INF


def test_a_float64_q_on_the_cpu_is_advised_a_dtype_that_runs_there():
    from varlen_workbench.kernels.varlen import varlen_attention
    from varlen_workbench.workbench.malformed import base_args, split_call

    args = {**base_args(), **{n: base_args()[n].double() for n in ("q", "k", "v")}}
    positional, keywords = split_call(args)
    with pytest.raises(TypeError, match=r"q has dtype torch\.float64; .* Cast with q\.to\(torch\.float32\)"):
        varlen_attention(*positional, **keywords)


@pytest.mark.parametrize("which", ["q", "k"])
def test_a_transposed_tensor_is_named_as_likely_transposed(which):
    from varlen_workbench.kernels.varlen import varlen_attention
    from varlen_workbench.workbench.malformed import base_args, split_call

    args = base_args()
    args[which] = args[which].transpose(1, 2).contiguous()  # (tokens, head_dim, heads)
    if which == "k":
        args["v"] = args["v"].transpose(1, 2).contiguous()
    positional, keywords = split_call(args)
    with pytest.raises(
        ValueError,
        match=rf"{which} has shape .*: is it \(tokens, head_dim, heads\), transposed\? Pass {which}\.transpose\(1, 2\)",
    ):
        varlen_attention(*positional, **keywords)


def test_the_single_block_reproduction_refuses_a_window():
    from varlen_workbench.postmortems.triton_interpreter_bf16_dot.probes import single_block_attention
    from varlen_workbench.workbench.malformed import base_args, split_call

    positional, keywords = split_call(base_args())
    with pytest.raises(ValueError, match=r"window_size = \(2, 0\): single_block_attention reproduces a kernel without"):
        single_block_attention(*positional, **keywords, window_size=(2, 0))
