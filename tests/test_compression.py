"""The inter-node compression's error feedback, alone, and where the settings allow it."""

import pytest
import torch

from hybrid.app.config import CommConfig
from hybrid.core.comm.compression import InterCompressor

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("kind, wire", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_error_feedback_sends_what_should_have_been_sent_up_to_one_rounding(kind, wire):
    """Sending the same value T times: the wire values add up to T x value, less the last residual only;
    a plain cast would be off by T x its rounding error."""
    gen = torch.Generator().manual_seed(0)
    value = torch.randn(1000, generator=gen) * 1e-3
    compressor = InterCompressor(kind)
    sent = torch.zeros(1000, dtype=torch.float64)
    steps = 64
    for _ in range(steps):
        out = compressor.compress_(value.clone(), key="bucket0")
        assert out.dtype == wire
        sent += out.double()
    residual = compressor._residuals["bucket0"].double()
    eps = torch.finfo(wire).eps
    # Exactly (up to fp32 arithmetic on the residual): sum of wire values = T * value - final residual.
    torch.testing.assert_close(sent + residual, steps * value.double(), rtol=0, atol=steps * 1e-9)
    assert residual.abs().max() <= eps * value.abs().max() * 2
    plain_error = (value.to(wire).double() - value.double()).abs().sum() * steps
    fed_back_error = (sent - steps * value.double()).abs().sum()
    assert fed_back_error < plain_error / 10


def test_each_key_keeps_its_own_residual_and_a_new_shape_starts_over():
    compressor = InterCompressor("bf16")
    a, b = torch.full((4,), 1.001), torch.full((4,), -3.0007)
    compressor.compress_(a.clone(), key=("bucket", 0))
    compressor.compress_(b.clone(), key=("bucket", 1))
    assert torch.equal(compressor._residuals[("bucket", 0)], a - a.to(torch.bfloat16).float())
    assert torch.equal(compressor._residuals[("bucket", 1)], b - b.to(torch.bfloat16).float())
    compressor.compress_(torch.ones(6), key=("bucket", 0))  # DDP rebuilt its buckets: another shape
    assert torch.equal(compressor._residuals[("bucket", 0)], torch.zeros(6))
    assert compressor.residual_bytes() == (6 + 4) * 4


def test_an_overflowing_value_reaches_the_step_but_not_the_residual():
    compressor = InterCompressor("fp16")
    out = compressor.compress_(torch.tensor([1e6, 1.0, float("nan")]), key="k")
    assert torch.isinf(out[0]) and torch.isnan(out[2])  # the step sees it (and stops or skips)
    assert torch.equal(compressor._residuals["k"], torch.zeros(3))
    assert torch.equal(compressor.compress_(torch.tensor([2.0, 2.0, 2.0]), key="k"), torch.full((3,), 2.0,
                                                                                                 dtype=torch.float16))


def test_low_precision_gradients_and_none_are_left_alone():
    assert not InterCompressor("none").applies_to(torch.ones(2))
    assert not InterCompressor("bf16").applies_to(torch.ones(2, dtype=torch.float16))
    assert InterCompressor("fp16").applies_to(torch.ones(2, dtype=torch.float64))


@pytest.mark.parametrize("algorithm", ["hierarchical", "sharded"])
def test_settings_accept_compression_for_the_two_level_algorithms(algorithm):
    assert CommConfig(algorithm=algorithm, inter_compression="bf16").inter_compression == "bf16"


@pytest.mark.parametrize("algorithm", ["flat", "ddp"])
def test_settings_refuse_compression_where_there_is_no_inter_node_phase(algorithm):
    with pytest.raises(ValueError, match=rf"comm.inter_compression='fp16' .* comm={algorithm} has none: use none"):
        CommConfig(algorithm=algorithm, inter_compression="fp16")


def test_settings_name_the_allowed_compressions():
    with pytest.raises(ValueError, match=r"comm.inter_compression='int8' is not one of none, bf16, fp16"):
        CommConfig(inter_compression="int8")


def test_residuals_move_through_a_state_dict_and_continue_exactly():
    gen = torch.Generator().manual_seed(1)
    values = [torch.randn(300, generator=gen) for _ in range(4)]
    straight, first = InterCompressor("fp16"), InterCompressor("fp16")
    for v in values[:2]:
        straight.compress_(v.clone(), key=(0, 300))
        first.compress_(v.clone(), key=(0, 300))
    state = first.state_dict()
    first.compress_(values[2].clone(), key=(0, 300))  # the saved copy does not move with the live residual
    resumed = InterCompressor("fp16")
    resumed.load_state_dict(state)
    for v in values[2:]:
        assert torch.equal(resumed.compress_(v.clone(), key=(0, 300)), straight.compress_(v.clone(), key=(0, 300)))
    with pytest.raises(ValueError, match=r"inter_compression='fp16' cannot continue inter_compression='bf16'"):
        InterCompressor("bf16").load_state_dict(state)


def test_residuals_return_to_their_rank_only_into_a_run_of_the_same_signature():
    import torch.distributed as dist

    from hybrid.app.state.error_feedback import ErrorFeedback, restore_residuals

    sig = {"comm": "sharded", "inter_compression": "bf16", "intra_mode": "process", "node_sizes": [1],
           "bucket_mb": 1.0, "chunk_bytes": 4096}
    compressor = InterCompressor("bf16")
    compressor.compress_(torch.full((5,), 1 / 3), key=(0, 5))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        saved = ErrorFeedback({"sharded": compressor}, sig).gather()
        assert saved["signature"] == sig and len(saved["ranks"]) == 1
        log: list[str] = []
        mine = restore_residuals(saved, sig, log.append)
        assert log == [] and torch.equal(mine["sharded"]["residuals"][(0, 5)], compressor._residuals[(0, 5)])
        other = {**sig, "bucket_mb": 2.0}
        assert restore_residuals(saved, other, log.append) is None
        assert restore_residuals(None, sig, log.append) is None
        assert restore_residuals(saved, None, log.append) is None  # an uncompressed run: nothing to say
        assert len(log) == 2
        assert log[0].startswith("error-feedback residuals start at zero: they were kept by ") and "'bucket_mb': 2.0" in log[0]
        assert "the checkpoint has none" in log[1]
    finally:
        dist.destroy_process_group()


def test_the_guard_checks_one_slice_every_k_uses_and_its_place_travels_through_a_state_dict():
    c = InterCompressor("bf16")
    c.guard(3, 0.05)
    due = []
    for _ in range(6):
        for key in ("a", "b"):  # two slices a step: only the first one seen is checked
            due.append(c.due(key))
    assert due == [False, False, False, False, True, False, False, False, False, False, True, False]
    full = torch.linspace(-1, 1, 1000, dtype=torch.float64).float()
    assert 0 < c.judge(full.to(torch.bfloat16).float(), full) < 0.01 and not c.fell_back
    assert c.applies_to(full)
    again = InterCompressor("bf16")
    again.guard(3, 0.05)
    again.load_state_dict(c.state_dict())
    assert [again.due("a") for _ in range(3)] == [c.due("a") for _ in range(3)] == [False, False, True]
    assert c.judge(full * 2, full) == pytest.approx(1.0) and c.fell_back  # far off: full precision from now on
    assert not c.applies_to(full) and c.checks[-1] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="check_every=-1 must be >= 0 and max_error=0.05 > 0"):
        c.guard(-1, 0.05)
