"""``python -m hybrid.bench ft``: the torchft side of the comparison runs through the bench's own code, so that the
comparison cannot rot when torchft moves.

A short torchft job of the bench (its lighthouse off the nodes, one replica group per testbed node, its DDP,
Manager and Optimizer) loses group 2 and gets it back: the survivors go on, the returning group heals from a
live peer, and every group ends with the same weights. Needs root (the testbed) and torchft (the test extra
installs it); elsewhere skipped with the reason.
"""

from __future__ import annotations

import pytest

from hybrid.runtime.testbed import testbed_available
from hybrid.tools import bench_ft
from hybrid.tools.bench_ft import HEALTHY, FtBenchOptions, run_torchft

REASON = testbed_available() or bench_ft.torchft_missing()
needs_testbed_and_torchft = pytest.mark.skipif(REASON is not None, reason=f"cannot run torchft's side: {REASON}")


@pytest.mark.testbed  # in the main lane, not the background one: it composes Hydra's config in this process and
@needs_testbed_and_torchft  # holds a testbed of this process, which tests/test_testbed.py looks for
def test_torchfts_groups_go_on_without_a_lost_one_and_heal_it_from_a_peer_when_it_returns(tmp_path):
    import torch

    from hybrid.app.checks import compose_train_config
    from hybrid.app.setup import build_model

    # 15 Mbit/s: each step's all-reduce waits about a second on the link, so the survivors cannot finish the 30
    # steps before the returning group's first one, however busy the machine is (it needs about 15 s).
    opts = FtBenchOptions(recovery_steps=30, kill_after=2, link_mbit=15.0, timeout_s=400)
    spec = next(s for s in HEALTHY if s.system == "torchft" and s.ft_mode == "ddp")
    row = run_torchft(spec, opts, "rejoin", tmp_path)
    assert row["identical"], row
    assert row["steps"] == opts.recovery_steps, row
    assert row["steps_lost"] == 0, row  # torchft redoes the step the loss broke, as hybrid does
    assert row["torchft_quorums"] >= opts.recovery_steps, row  # a quorum per step: torchft really ran
    model = build_model(compose_train_config(list(bench_ft.TASK)).model, torch.device("cpu"))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert row["received_bytes"] >= 3 * weights, row  # the weights and AdamW's two moments, from a live peer
    assert "from replica rank(s) 0" in row["received"] or "from replica rank(s) 1" in row["received"], row


@pytest.mark.unit
@pytest.mark.parametrize(("args", "named"), [
    (["--scenarios", "healthy,bogus"], "'healthy,bogus': choose from healthy, kill, rejoin, diloco"),
    (["--layouts", "4x2"], "'4x2': choose from 3x1, 3x2"),
    (["--kill-after", "40", "--recovery-steps", "30"], "--kill-after 40 must be below --recovery-steps 30"),
])
def test_bad_bench_ft_options_are_refused_in_one_line_naming_the_value(args, named, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        bench_ft.main([*args, "--json", str(tmp_path / "rows.json")])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert named in error, error
    assert not (tmp_path / "rows.json").exists()
