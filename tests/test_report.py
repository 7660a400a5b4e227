"""hybrid.tools.report on a sweep directory laid out as Hydra writes it (jobs made up here)."""

import json
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import hybrid.app.checks  # noqa: F401  registers the schema (train_schema) with Hydra's ConfigStore
from hybrid.app.config import packaged_conf_dir

pytestmark = pytest.mark.multiprocess

MB25 = 25 * 2**20


def make_job(root, num, nnodes, nproc, comm, comm_s=None, step_s=1.0, finished=True, extra=None, overrides=()):
    job = root / str(num)
    (job / ".hydra").mkdir(parents=True)
    with initialize_config_dir(config_dir=str(packaged_conf_dir()), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"cluster.nnodes={nnodes}", f"cluster.nproc_per_node={nproc}",
                                                       f"comm={comm}", "model.width=1024", "model.depth=6", *overrides])
    OmegaConf.save(cfg, job / ".hydra" / "config.yaml")  # as Hydra writes it (interpolations kept)
    if finished:
        phases = {"flat_allreduce": 0.0, "intra_reduce": 0.0, "inter_allreduce": 0.0, "intra_broadcast": 0.0}
        phases.update(comm_s or {})
        (job / "metrics.json").write_text(json.dumps({
            "steps": 10, "steps_run": 10, "comm_s": {k: v * 10 for k, v in phases.items()},
            "bytes": {k: 0 for k in phases}, "mean_step_s": step_s, "median_step_s": step_s,
            "samples_per_s": 256 / step_s, "param_bytes": MB25, "final_loss": 1.0, **(extra or {})}))


def test_report_tables_speedups_failures_and_plot(tmp_path):
    # Per step: flat 0.8 s of communication; hierarchical 0.5 s; sharded 0.45 s.
    make_job(tmp_path, 0, 2, 4, "flat", {"flat_allreduce": 0.8}, step_s=1.2)
    make_job(tmp_path, 1, 2, 4, "hierarchical", {"intra_reduce": 0.1, "inter_allreduce": 0.3, "intra_broadcast": 0.1},
             step_s=0.9)
    make_job(tmp_path, 2, 2, 4, "sharded", {"intra_reduce": 0.1, "inter_allreduce": 0.25, "intra_broadcast": 0.1},
             step_s=0.85)
    make_job(tmp_path, 3, 4, 2, "hierarchical", {"intra_reduce": 0.05, "inter_allreduce": 0.5, "intra_broadcast": 0.05})
    make_job(tmp_path, 4, 2, 4, "ddp", step_s=1.3)
    make_job(tmp_path, 5, 4, 2, "flat", finished=False)  # failed or still running
    out = subprocess.run([sys.executable, "-m", "hybrid.report", str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    report = (tmp_path / "report.md").read_text()
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): [c.strip() for c in line.split("|")[1:-1]]
            for line in report.splitlines() if line.startswith("| 2x4") or line.startswith("| 4x2")}
    assert rows[("2x4", "hierarchical")][9] == "1.60"  # comm speed-up: 0.8 / 0.5
    assert rows[("2x4", "sharded")][9] == "1.78"
    assert rows[("2x4", "hierarchical")][10] == "1.33"  # step speed-up: 1.2 / 0.9
    assert rows[("2x4", "ddp")][3:8] == ["-"] * 5  # torch runs DDP's all-reduce: no phase counters
    assert "5: 4x2 flat mlp w1024 d6" in report  # listed, not dropped
    assert "Median absolute prediction error" in report and "Calibrated cost model" in report
    assert (tmp_path / "report.png").stat().st_size > 1000
    assert "5/6 jobs finished" in out.stdout


def test_report_rejects_a_directory_without_jobs(tmp_path):
    out = subprocess.run([sys.executable, "-m", "hybrid.report", str(tmp_path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "holds no Hydra jobs" in out.stderr


def test_auto_jobs_are_set_against_the_fastest_fixed_algorithm(tmp_path):
    make_job(tmp_path, 0, 2, 4, "flat", {"flat_allreduce": 0.8}, step_s=1.2)
    make_job(tmp_path, 1, 2, 4, "hierarchical", {"intra_reduce": 0.1, "inter_allreduce": 0.3}, step_s=0.9)
    make_job(tmp_path, 2, 2, 4, "sharded", {"intra_reduce": 0.1, "inter_allreduce": 0.25}, step_s=0.85)
    decisions = [{"bytes": 2**20, "chosen": "flat", "predicted_s": {}}, {"bytes": MB25, "chosen": "hierarchical",
                                                                        "predicted_s": {}}]
    make_job(tmp_path, 3, 2, 4, "auto", {"intra_reduce": 0.1, "inter_allreduce": 0.3}, step_s=0.88,
             extra={"comm_auto": {"decisions": decisions}, "runs_as": f"1048576:flat,{MB25}:hierarchical"})
    out = subprocess.run([sys.executable, "-m", "hybrid.report", str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    report = (tmp_path / "report.md").read_text()
    row = next(line for line in report.splitlines() if line.startswith("| mlp w1024 d6 | 2x4 |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    # Step: sharded is fastest (0.85 s); communication: sharded too (0.35 s per step against auto's 0.4 s).
    assert cells[2:] == [f"1048576:flat,{MB25}:hierarchical", "880.0", "sharded", "850.0", "1.035",
                         "400.0", "sharded", "350.0", "1.143"]
    assert "auto / best step time: worst 1.035" in report


def _ranks(compute, comm_wait, step, exposed):
    phases = {"flat_allreduce": 0.0, "intra_reduce": 0.0, "inter_allreduce": 0.0, "intra_broadcast": 0.0}
    return [{"rank": r, "node": r // 2, "compute_s": compute, "comm_wait_s": comm_wait, "step_s": step,
             "exposed_s": {**phases, **exposed}, "phase_s": {**phases, **exposed}} for r in range(4)]


def test_the_breakdown_stacks_compute_exposed_phases_and_the_rest_per_comm(tmp_path):
    make_job(tmp_path, 0, 2, 2, "hierarchical", {"inter_allreduce": 0.4}, step_s=0.9,
             extra={"ranks": _ranks(0.5, 0.3, 0.9, {"inter_allreduce": 0.2, "intra_broadcast": 0.05})})
    make_job(tmp_path, 1, 2, 2, "ddp", step_s=1.0, extra={"ranks": _ranks(0.6, 0.4, 1.0, {})})
    make_job(tmp_path, 2, 2, 2, "flat", {"flat_allreduce": 0.5}, step_s=1.1)  # an older run: no accounts
    out = subprocess.run([sys.executable, "-m", "hybrid.report", str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    report = (tmp_path / "report.md").read_text()
    table = report[report.index("## Where a step's time goes"):].splitlines()
    rows = {line.split("|")[3].strip(): [c.strip() for c in line.split("|")[4:-1]] for line in table
            if line.startswith("| mlp")}
    # compute, flat / intra_reduce / inter / intra_broadcast exposed, comm_wait without a phase, other
    assert rows["hierarchical"] == ["500.0", "0.0", "0.0", "200.0", "50.0", "50.0", "100.0"]
    assert rows["ddp"] == ["600.0", "0.0", "0.0", "0.0", "0.0", "400.0", "0.0"]
    assert "flat" not in rows
    assert (tmp_path / "report_breakdown.png").stat().st_size > 1000


def test_the_peers_table_sets_torchs_own_comms_beside_hybrids_with_memory_network_and_loss(tmp_path):
    """hsdp, DDP with torch's fp16 hook and hybrid's 16-bit inter-node hop are rows of their own (not folded
    into ddp or hierarchical), with samples/s against plain DDP, the largest rank's peak RSS, the busiest
    node's NIC bytes per step and the final loss; torch's own comms show no hybrid phases."""
    peers = {"peak_rss_mb": [900.0, 700.0], "nic_tx_bytes_per_step": 25e6, "final_loss": 2.0, "tail_loss": 2.5}
    make_job(tmp_path, 0, 2, 4, "ddp", step_s=1.0, extra=peers)
    make_job(tmp_path, 1, 2, 4, "ddp", step_s=0.8, extra={**peers, "nic_tx_bytes_per_step": 12.5e6},
             overrides=["comm.torch_hook=fp16"])
    make_job(tmp_path, 2, 2, 4, "hsdp", step_s=0.5, extra={**peers, "peak_rss_mb": [500.0, 400.0]})
    make_job(tmp_path, 3, 2, 4, "hierarchical", {"intra_reduce": 0.1, "inter_allreduce": 0.2, "intra_broadcast": 0.1},
             step_s=0.4, extra={**peers, "final_loss": 2.01}, overrides=["comm.inter_compression=bf16"])
    # A plain hierarchical job calibrates the cost model, which then prices jobs: not the 16-bit ones.
    make_job(tmp_path, 4, 2, 4, "hierarchical", {"intra_reduce": 0.1, "inter_allreduce": 0.4, "intra_broadcast": 0.1},
             step_s=0.6, extra=peers)
    out = subprocess.run([sys.executable, "-m", "hybrid.report", str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    report = (tmp_path / "report.md").read_text()
    peers_part = report.split("## Side by side with torch's own")[1].split("##")[0]
    rows = {line.split("|")[3].strip(): [c.strip() for c in line.split("|")[4:-1]]
            for line in peers_part.splitlines() if line.startswith("| mlp")}
    assert rows["ddp"] == ["256", "1.00", "900", "25.00", "2.0000", "2.5000"]
    assert rows["ddp+fp16"] == ["320", "1.25", "900", "12.50", "2.0000", "2.5000"]
    assert rows["hsdp"] == ["512", "2.00", "500", "25.00", "2.0000", "2.5000"]
    assert rows["hierarchical+bf16"] == ["640", "2.50", "900", "25.00", "2.0100", "2.5000"]
    main = {tuple(c.strip() for c in line.split("|")[1:3]): [c.strip() for c in line.split("|")[1:-1]]
            for line in report.split("## Side by side")[0].splitlines() if line.startswith("| 2x4")}
    assert main[("2x4", "hsdp")][3:8] == ["-"] * 5 and main[("2x4", "ddp+fp16")][3:8] == ["-"] * 5
    assert main[("2x4", "hierarchical+bf16")][4] == "200.0"  # its inter phase, ms per step
