"""Bad values at the API's edges get errors that name the argument and list the choices."""

import pytest

from workbench import Case, Fill


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
