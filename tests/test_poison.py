"""poisoned_memory: fresh buffers hold NaN inside, every global setting is restored after, also on exceptions."""

import pytest
import torch

from varlen_workbench.workbench.instruments.poison import poisoned_memory


def _settings():
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )


def test_fresh_buffers_are_nan_inside():
    with poisoned_memory():
        assert torch.isnan(torch.empty(64)).all()
        assert torch.isnan(torch.empty_like(torch.ones(3, 5))).all()
        assert (torch.empty(4, dtype=torch.int32) == torch.iinfo(torch.int32).max).all()


def test_settings_restored_after_an_exception():
    torch.use_deterministic_algorithms(False)
    torch.utils.deterministic.fill_uninitialized_memory = False
    before = _settings()
    with pytest.raises(RuntimeError, match="planted"):
        with poisoned_memory():
            assert _settings() == (True, True, True)
            raise RuntimeError("planted")
    assert _settings() == before


def test_user_settings_are_restored_exactly():
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        with poisoned_memory():
            pass
        assert _settings()[:2] == (True, False)
    finally:
        torch.use_deterministic_algorithms(False)


def test_negative_prefill_is_refused():
    with pytest.raises(ValueError, match="cuda_prefill_mb"):
        with poisoned_memory(cuda_prefill_mb=-1):
            pass


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_prefill_makes_cached_blocks_nan():
    torch.cuda.empty_cache()
    with poisoned_memory(cuda_prefill_mb=16):
        pass
    # Outside deterministic mode, a fresh buffer reuses a cached block the pre-fill left NaN.
    assert not torch.are_deterministic_algorithms_enabled()
    fresh = torch.empty(1 << 16, device="cuda")
    assert torch.isnan(fresh).any()
