"""python -m hybrid.bench train: the trainer benchmark's sums, bad input, and a real (tiny) run."""

import json
import subprocess
import sys

import pytest

from hybrid.tools.bench_train import TrainBenchOptions, compose_settings, summarise


def bench_train(*args, cwd=None, timeout=400):
    return subprocess.run([sys.executable, "-m", "hybrid.bench", "train", *args],
                          capture_output=True, text=True, cwd=cwd, timeout=timeout)


def _run(sps, rss, comm_s=0.0, loss=1.0):
    return {"samples_per_s": sps, "median_step_s": 1 / sps, "peak_rss_mb": rss, "comm_s_per_step": comm_s,
            "final_loss": loss}


@pytest.mark.unit
def test_summary_takes_medians_ratios_to_the_baseline_and_weak_scaling():
    opts = TrainBenchOptions(layouts=["1x1", "2x2"], comms=["ddp", "flat"], rounds=3)
    runs = {
        "1x1 ddp": [_run(100, [200]), _run(110, [210]), _run(90, [190])],
        "1x1 flat": [_run(100, [205]), _run(100, [205]), _run(100, [205])],
        "2x2 ddp": [_run(300, [300, 310, 305, 290]), _run(320, [300] * 4), _run(1, [300] * 4)],
        "2x2 flat": [_run(330, [330] * 4), _run(333, [330] * 4), _run(340, [330, 320, 310, 300])],
    }
    rows = {(r["layout"], r["comm"]): r for r in summarise(opts, runs)}
    assert rows[("2x2", "ddp")]["samples_per_s"] == 300  # the median: one bad round does not count
    assert rows[("2x2", "ddp")]["peak_rss_mb"] == 300  # median over rounds of the largest rank
    assert rows[("2x2", "ddp")]["peak_rss_mb_by_rank"] == [300, 300, 300, 300]  # per rank, median over rounds
    assert rows[("2x2", "flat")]["peak_rss_mb_by_rank"] == [330] * 4 and rows[("1x1", "ddp")]["peak_rss_mb_by_rank"] == [200]
    assert rows[("2x2", "flat")]["final_loss"] == 1.0 and "nic_tx_bytes_per_step" not in rows[("2x2", "flat")]
    assert "optimizer_state_bytes" not in rows[("2x2", "flat")]  # runs that did not report it
    # Paired by round (330/300, 333/320, 340/1), then the median: not the ratio of the medians (333/300).
    assert rows[("2x2", "flat")]["speed_vs_baseline_per_round"] == pytest.approx([330 / 300, 333 / 320, 340])
    assert rows[("2x2", "flat")]["speed_vs_baseline"] == pytest.approx(330 / 300)
    assert rows[("2x2", "flat")]["rss_vs_baseline"] == pytest.approx(330 / 300)
    assert rows[("1x1", "ddp")]["weak_scaling_efficiency"] == pytest.approx(1.0)
    assert rows[("2x2", "ddp")]["weak_scaling_efficiency"] == pytest.approx(300 / (4 * 100))
    assert rows[("2x2", "flat")]["weak_scaling_efficiency"] == pytest.approx(333 / (4 * 100))


@pytest.mark.unit
def test_compose_settings_is_the_trainers_config_and_rejects_uneven_layouts():
    cfg = compose_settings(["model.width=32"], "2x3", "sharded", 7, 0.0)
    assert (cfg.cluster.nnodes, cfg.cluster.nproc_per_node) == (2, 3)
    assert (cfg.comm.algorithm, cfg.trainer.max_steps, cfg.model.get("width")) == ("sharded", 7, 32)
    assert not cfg.cluster.testbed.enabled
    assert compose_settings([], "2x1", "ddp", 5, 300.0).cluster.testbed.link_mbit == 300.0
    hooked = compose_settings([], "2x2", "ddp+fp16", 5, 0.0)  # torch's own hook on plain DDP
    assert (hooked.comm.algorithm, hooked.comm.torch_hook, hooked.comm.inter_compression) == ("ddp", "fp16", "none")
    compressed = compose_settings([], "2x2", "sharded+bf16", 5, 0.0)  # hybrid's 16-bit inter-node hop
    assert (compressed.comm.torch_hook, compressed.comm.inter_compression) == ("none", "bf16")
    assert compose_settings([], "2x2", "hsdp", 5, 0.0).comm.algorithm == "hsdp"
    # One command, two networks: a comm@loopback runs without the testbed's shaped NICs; comm=diloco's own keys
    # reach its configurations only (comm=ddp would refuse comm.sync_every).
    diloco = compose_settings(["comm.sync_every=8"], "2x4", "diloco+fp8", 5, 50.0)
    assert (diloco.comm.algorithm, diloco.comm.sync_every, diloco.comm.inter_compression) == ("diloco", 8, "fp8")
    assert diloco.cluster.testbed.enabled and diloco.cluster.testbed.link_mbit == 50.0
    ceiling = compose_settings(["comm.sync_every=8"], "2x4", "ddp@loopback", 5, 50.0)
    assert (ceiling.comm.algorithm, ceiling.cluster.testbed.enabled) == ("ddp", False)
    # Only DiLoCo's keys are left out: comm.inter_compression (a prefix of none of them) still reaches hierarchical.
    hier = compose_settings(["comm.inter=sharded", "comm.outer_optim.lr=1.0", "comm.inter_compression=bf16"], "2x2",
                            "hierarchical", 5, 0.0)
    assert (hier.comm.algorithm, hier.comm.inter_compression) == ("hierarchical", "bf16")
    with pytest.raises(ValueError, match="'3,1'"):
        compose_settings([], "3,1", "flat", 5, 0.0)


@pytest.mark.unit
@pytest.mark.parametrize(
    "args,needle",
    [
        (["--comms", "ddp,bogus"], "'ddp,bogus'"),
        (["--comms", "ddp@wan,diloco"], "'ddp@wan,diloco'"),
        (["--steps", "1"], "--steps 1"),
        (["--layouts", "2y2"], "'2y2'"),
        (["model.width=-3"], "model.width=-3"),
        (["model.nosuch=1"], "nosuch"),
        (["comm=flat"], "'comm=flat'"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(args, needle, tmp_path, monkeypatch, capsys):
    from hybrid.tools.bench_train import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--output", str(tmp_path / "t.json")])
    assert exit_info.value.code == 2
    error_lines = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(error_lines) == 1 and needle in error_lines[0], error_lines
    assert list(tmp_path.iterdir()) == []


@pytest.mark.multiprocess
def test_tiny_run_reports_every_configuration(tmp_path):
    out = bench_train("--layouts", "1x1,1x2", "--comms", "ddp,hsdp", "--steps", "4", "--rounds", "1",
                      "--output", str(tmp_path / "t.json"),
                      "model.width=16", "model.depth=1", "data.num_samples=256", "data.batch_size=8", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "weak-scaling eff" in out.stdout and "vs ddp" in out.stdout and "final loss" in out.stdout
    report = json.loads((tmp_path / "t.json").read_text())
    rows = {(r["layout"], r["comm"]): r for r in report["summary"]}
    assert set(rows) == {(layout, c) for layout in ("1x1", "1x2") for c in ("ddp", "hsdp")}
    for (layout, comm), row in rows.items():
        (run,) = report["runs"][f"{layout} {comm}"]
        assert len(run["peak_rss_mb"]) == row["world_size"]  # one figure per rank, from each worker
        assert all(20 < mb < 20_000 for mb in run["peak_rss_mb"])
        assert row["samples_per_s"] == pytest.approx(run["samples_per_s"]) and row["samples_per_s"] > 0
        assert row["final_loss"] == run["final_loss"] > 0 and len(row["peak_rss_mb_by_rank"]) == row["world_size"]
    assert rows[("1x2", "ddp")]["speed_vs_baseline"] == 1.0 and "optim MB" in out.stdout
    # SGD's momentum: one fp32 value per parameter on every DDP worker; FSDP2's workers hold half of it each.
    assert rows[("1x2", "ddp")]["optimizer_state_bytes"] == report["param_bytes"]
    assert rows[("1x2", "hsdp")]["optimizer_state_bytes"] <= 0.6 * report["param_bytes"]
    assert rows[("1x2", "hsdp")]["weak_scaling_efficiency"] == pytest.approx(
        rows[("1x2", "hsdp")]["samples_per_s"] / (2 * rows[("1x1", "hsdp")]["samples_per_s"]))
    # FSDP2 (1x2: both workers shard one node) trains the model DDP trains, to float rounding.
    assert rows[("1x2", "hsdp")]["final_loss"] == pytest.approx(rows[("1x2", "ddp")]["final_loss"], rel=1e-5)
    # Nothing of the runs is left behind but the report (and the synthetic data, reused by later runs).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "t.json"]
