"""``python -m hybrid.bench ft``: the torchft side of the comparison runs through the bench's own code, so that the
comparison cannot rot when torchft moves.

A short torchft job of the bench (its lighthouse off the nodes, one replica group per testbed node, its DDP,
Manager and Optimizer) loses group 2 and gets it back: the survivors go on, the returning group heals from a
live peer, and every group ends with the same weights. Needs root (the testbed) and torchft (the test extra
installs it); elsewhere skipped with the reason.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile

import pytest

from hybrid.runtime.testbed import testbed_available
from hybrid.tools import bench_ft
from hybrid.tools.bench_ft import FtBenchOptions

from helpers import background
from helpers.processes import job_env

REASON = testbed_available() or bench_ft.torchft_missing()
needs_testbed_and_torchft = pytest.mark.skipif(REASON is not None, reason=f"cannot run torchft's side: {REASON}")
# 15 Mbit/s: each step's all-reduce waits about a second on the link, so the survivors cannot finish the 30 steps
# before the returning group's first one, however busy the machine is (it needs about 15 s).
OPTS = FtBenchOptions(recovery_steps=30, kill_after=2, link_mbit=15.0, timeout_s=400)
# The bench's own run_torchft, in a process of its own: the testbed is that process's, not this session's (which
# tests/test_testbed.py looks for), and the job, mostly waiting on the slow link, runs beside the lane.
_ROW = """import json, sys
from pathlib import Path
from hybrid.tools import bench_ft
spec = next(s for s in bench_ft.HEALTHY if s.system == "torchft" and s.ft_mode == "ddp")
opts = bench_ft.FtBenchOptions(**json.loads(sys.argv[1]))
print("ROW", json.dumps(bench_ft.run_torchft(spec, opts, "rejoin", Path(sys.argv[2]))))
"""
TEST = "test_bench_ft.py::test_torchfts_groups_go_on_without_a_lost_one_and_heal_it_from_a_peer_when_it_returns"


def _rejoin_row() -> dict:
    where = tempfile.mkdtemp(prefix="hybrid-bench-ft-")
    run = background.track(subprocess.Popen(
        [sys.executable, "-c", _ROW, json.dumps(dataclasses.asdict(OPTS)), where], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True, env=job_env()))
    out, _ = run.communicate(timeout=OPTS.timeout_s + 60)
    rows = [line.removeprefix("ROW ") for line in out.splitlines() if line.startswith("ROW ")]
    assert run.returncode == 0 and rows, out[-4000:]
    return json.loads(rows[-1])


if REASON is None:
    background.declare("torchft rejoin", lambda test_id: test_id.endswith(TEST), _rejoin_row, beside=True)


@pytest.mark.testbed
@needs_testbed_and_torchft
def test_torchfts_groups_go_on_without_a_lost_one_and_heal_it_from_a_peer_when_it_returns():
    import torch

    from hybrid.app.checks import compose_train_config
    from hybrid.app.setup import build_model

    row = background.result("torchft rejoin")
    assert row["identical"], row
    assert row["steps"] == OPTS.recovery_steps, row
    assert row["steps_lost"] == 0, row  # torchft redoes the step the loss broke, as hybrid does
    assert row["torchft_quorums"] >= OPTS.recovery_steps, row  # a quorum per step: torchft really ran
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
