"""python -m hybrid.train end to end: the default job, its outputs, bad input, torchrun."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybrid.app.checks import compose_train_config
from hybrid.runtime.launch import free_port

SMALL = ["trainer.max_steps=6", "trainer.log_every=3", "data.num_samples=1024", "model.width=32"]


def hybrid_train(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybrid.train", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("default-run")
    start = time.monotonic()
    out = hybrid_train(cwd=cwd)
    return cwd, out, time.monotonic() - start


@pytest.mark.multiprocess
def test_default_job_finishes_and_says_where_results_are(default_run):
    """How fast is measured in the README; here only a gross regression fails."""
    cwd, out, elapsed = default_run
    assert out.returncode == 0, out.stderr[-3000:]
    assert elapsed < 180
    tb = re.search(r"TensorBoard logs: (\S+)", out.stdout)
    metrics = re.search(r"metrics: (\S+)", out.stdout)
    assert tb and metrics and Path(tb.group(1)).is_dir() and Path(metrics.group(1)).is_file()
    assert re.search(r"step 50/50\s+loss [\d.]+\s+lr [\d.e-]+\s+\d+ samples/s", out.stdout)
    # The first line says what runs and where its logs go.
    first = out.stdout.splitlines()[0]
    assert re.fullmatch(r"hybrid: 2 nodes x 2 workers, comm=hierarchical, model mlp \(w256 d4\), [\d.]+ [KMG]iB of "
                        r"gradients; logs and TensorBoard in outputs/runs/\S+_hierarchical_2x2", first), first
    # The simulated nodes share this machine's CPUs and have no limits of their own: contention, not a straggler.
    assert "is the slowest" not in out.stdout


@pytest.mark.multiprocess
def test_metrics_json_has_the_documented_keys(default_run):
    cwd, out, _ = default_run
    metrics = json.loads(Path(re.search(r"metrics: (\S+)", out.stdout).group(1)).read_text())
    for key in ("comm", "nnodes", "nproc_per_node", "world_size", "steps", "final_loss", "samples_per_s",
                "mean_step_s", "comm_s", "bytes", "param_checksum"):
        assert key in metrics, key
    assert metrics["comm"] == "hierarchical" and metrics["nnodes"] == 2 and metrics["world_size"] == 4
    assert metrics["steps"] == 50 and metrics["param_checksums_identical"]
    assert set(metrics["comm_s"]) == set(metrics["bytes"]) == {
        "flat_allreduce", "intra_reduce", "inter_allreduce", "intra_broadcast"}
    assert metrics["bytes"]["inter_allreduce"] > 0 and metrics["comm_s"]["intra_reduce"] > 0
    assert metrics["straggler_candidates"] == [] and metrics["slowest_node"] is None
    assert len(metrics["node_hosts"]) == 2 and len(set(metrics["node_hosts"])) == 1


@pytest.mark.multiprocess
def test_only_rank_zero_writes_one_run_dir(default_run):
    cwd, out, _ = default_run
    runs = list((cwd / "outputs" / "runs").iterdir())
    assert len(runs) == 1
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d-\d{6}_hierarchical_2x2", runs[0].name), runs[0].name
    assert sorted(p.name for p in runs[0].iterdir()) == [".hydra", "checkpoints", "metrics.json", "tb", "train.log"]
    assert sorted(p.name for p in cwd.iterdir()) == ["data", "outputs"]
    # train.log holds what the run printed (rank 0's lines and the launcher's summary), time-stamped.
    logged = [line.split("] ", 1)[1] for line in (runs[0] / "train.log").read_text().splitlines()]
    assert logged == out.stdout.splitlines()
    assert logged[0].startswith("hybrid: 2 nodes x 2 workers") and logged[-1].startswith("metrics: ")
    assert sum(line.startswith("step ") for line in logged) == 5


@pytest.mark.multiprocess
def test_tensorboard_has_per_phase_scalars_and_hparams(default_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    cwd, out, _ = default_run
    acc = EventAccumulator(re.search(r"TensorBoard logs: (\S+)", out.stdout).group(1))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("train/loss", "train/lr", "train/samples_per_s", "train/step_time_s"):
        assert tag in tags
    for phase in ("intra_reduce", "inter_allreduce", "intra_broadcast"):
        assert f"comm/{phase}_s" in tags and f"comm/{phase}_bytes" in tags
    assert [e.step for e in acc.Scalars("train/loss")] == [10, 20, 30, 40, 50]
    content = acc.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = start.session_start_info.hparams
    assert {"nnodes", "nproc_per_node", "comm", "bucket_mb", "param_bytes", "width", "depth"} <= set(hparams)
    # Numbers as numbers (nproc_per_node too, not the string '2'), names as strings.
    kinds = {k: v.WhichOneof("kind") for k, v in hparams.items()}
    numbers = {"nnodes", "nproc_per_node", "world_size", "bucket_mb", "param_bytes", "width", "depth", "batch_size", "lr"}
    assert {k for k, kind in kinds.items() if kind == "number_value"} == numbers, kinds
    assert {k for k, kind in kinds.items() if kind != "number_value"} == {k for k, kind in kinds.items()
                                                                          if kind == "string_value"}
    assert (hparams["nnodes"].number_value, hparams["nproc_per_node"].number_value) == (2, 2)
    assert hparams["comm"].string_value == "hierarchical" and hparams["torch_hook"].string_value == "none"


@pytest.mark.multiprocess
def test_tensorboard_names_a_single_run_by_its_comm_and_layout(default_run):
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    cwd, _, _ = default_run
    (name,) = EventMultiplexer().AddRunsFromDirectory(str(cwd / "outputs" / "runs")).Runs()  # as tensorboard finds it
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_[\d-]+_hierarchical_2x2/tb", name), name


BAD = [
    (["cluster.nnodes=0"], "cluster.nnodes=0 must be >= 1"),
    (["data.batch_size=-4"], "data.batch_size=-4 must be >= 1"),
    (["comm=ring"], "comm='ring' is not one of adaptive, auto, ddp, diloco, flat, hierarchical, hsdp, sharded"),
    (["model=resnet"], "model='resnet' is not one of cnn, gpt2, mlp, transformer"),
    (["data=text"], "data=text is next-byte prediction for a language model: model=mlp cannot train on it"),
    (["data=text", "model=cnn"], "data=text is next-byte prediction for a language model: model=cnn cannot train on "
                                 "it; use model=transformer or model=gpt2"),
    (["data=text", "model=transformer", "data.text_files=[/no/such/*.txt]"],
     "data.text_files=['/no/such/*.txt'] matches no file"),
    (["data=files", "data.inputs=/no/such/file.npy"], "data.inputs='/no/such/file.npy' does not exist"),
    (["optim.lr=fast"], "optim.lr='fast' is not a number (SGD's default is 0.001)"),
    (["+optim.nesterov_typo=true"], "optim._target_=torch.optim.SGD: TypeError: got an unexpected keyword argument "
                                    "'nesterov_typo'"),
    (["optim.warmup_steps=soon"], "optim.warmup_steps='soon' is not an int"),
    (["model.width=0"], "model.width=0 must be an integer >= 1"),
    (["comm.bucket_mb=big"], "comm.bucket_mb: Value 'big'"),
    (["comm.typo=1"], "comm.typo: Key 'typo' not in 'CommConfig'"),
    (["trainer.max_step=5"], "trainer.max_step: Key 'max_step' not in 'TrainerConfig'; did you mean trainer.max_steps?"),
    (["trainr.max_steps=5"], "did you mean trainer?"),
    (["cluster.testbed.link_mbits=100"], "did you mean cluster.testbed.link_mbit?"),
    (["model.widht=512"], "model.widht: Key 'widht' is not in struct; did you mean model.width?"),
    (["data.batch_sise=8"], "data.batch_sise: Key 'batch_sise' is not in struct; did you mean data.batch_size?"),
    (["optim.lrr=0.1"], "did you mean optim.lr?"),
    (["model.zzz=1"], "model.zzz: Key 'zzz' is not in struct; to pass a new argument, +model.zzz=..."),
    (["trainer.device=cuda"], "trainer.device='cuda' but torch.cuda.is_available() is False"),
    (["trainer.resume=true"], "trainer.resume=true continues the run in hydra.run.dir"),
    (["trainer.resume=/no/such/run"], "'/no/such/run' does not exist or is not a directory"),
    (["cluster.max_restarts=-2"], "cluster.max_restarts=-2 must be >= -1"),
    (["cluster.rdzv_endpoint=nohost"], "cluster.rdzv_endpoint='nohost' must be HOST:PORT (a port 1-65535)"),
    (["cluster.rdzv_backend=zookeeper"], "cluster.rdzv_backend='zookeeper' is not one of c10d, etcd"),
    (["cluster.rdzv_backend=etcd", "cluster.rdzv_endpoint='h1:2379,h2'"],  # quoted: Hydra splits a bare a,b
     "cluster.rdzv_endpoint='h1:2379,h2': etcd member 'h2' must be HOST:PORT (a port 1-65535)"),
    (["cluster.rdzv_endpoint=10.0.0.1:29400", "cluster.testbed.enabled=true"],
     "cluster.rdzv_endpoint='10.0.0.1:29400' cannot be reached from the testbed's namespaces"),
    (["cluster.testbed.link_schedule=[[4,20]]"],
     "cluster.testbed.link_schedule needs cluster.testbed.enabled=true: it reshapes the testbed's links"),
    (["cluster.testbed.enabled=true", "cluster.testbed.link_schedule=[[4,20],[4,500]]"],
     "cluster.testbed.link_schedule entry [4, 500]: 4 must come after the entry before it (4)"),
    (["cluster.testbed.enabled=true", "cluster.testbed.link_schedule=[[4,20]]", "cluster.testbed.link_schedule_unit=min"],
     "cluster.testbed.link_schedule_unit='min' is not one of step, s"),
    (["comm=flat", "comm.adapt_every=5"], "comm.adapt_every=5 times the inter-node phase of comm hierarchical, sharded or adaptive"),
    (["comm=adaptive", "comm.adapt_every=0"], "comm=adaptive needs comm.adapt_every=N (measure the link every N steps) "
                                               "or comm.adapt_plan=[[after_step, mode], ...]"),
    (["comm=adaptive", "comm.adapt_modes=[hierarchical,hierarchical+fp16]"],
     "comm.adapt_modes=['hierarchical', 'hierarchical+fp16'] must list some of hierarchical, sharded, "
     "hierarchical+bf16, sharded+bf16, diloco"),
    (["comm=adaptive", "comm.adapt_plan=[[8,ring]]"], "comm.adapt_plan entry [8, 'ring']: mode 'ring' is not one of"),
    (["comm=adaptive", "comm.adapt_plan=[[8,diloco],[4,sharded]]"], "must list its steps in increasing order"),
    (["comm=adaptive", "comm.adapt_modes=[hierarchical,diloco]", "comm.adapt_plan=[[4,sharded+bf16]]"],
     "comm.adapt_plan names sharded+bf16, which is not in comm.adapt_modes=['hierarchical', 'diloco']"),
    (["comm=adaptive", "comm.inter=sharded"], "comm.inter='sharded' is not one of auto, hierarchical (comm=adaptive's"),
    (["comm=adaptive", "comm.sync_every=3", "comm.fragments=2"], "comm.fragments=2 must divide comm.sync_every=3"),
    (["comm=adaptive", "comm.inter_compression=fp4"], "comm.inter_compression='fp4' is not one of none, bf16, fp16, fp8"),
    (["comm=hierarchical", "comm.adapt_plan=[[4,diloco]]"], "comm.adapt_plan and comm.adapt_modes apply to comm=adaptive only"),
    (["comm=adaptive", "cluster.nnodes=1"], "must be >= 2 with cluster.intra_mode=process"),
    (["comm.compression_check_every=-5"], "comm.compression_check_every=-5 must be a whole number of steps >= 0"),
    (["comm.max_compression_error=0"], "comm.max_compression_error=0.0 must be a relative error > 0"),
    (["comm.adapt_every=-1"], "comm.adapt_every=-1 must be a whole number of steps >= 0 (0: off)"),
    (["cluster.nnodes=1", "comm.adapt_every=5"], "comm.adapt_every=5 measures the link between nodes in process mode"),
    (["cluster.rdzv_port=70000"], "cluster.rdzv_port=70000 must be 0 (derived from the Slurm job id) or a port, 1-65535"),
    (["trainer.keep_checkpoints=0"], "trainer.keep_checkpoints=0 must be >= 1"),
    (["trainer.nonfinite_grads=ignore"], "trainer.nonfinite_grads='ignore' is not one of stop, skip"),
    (["trainer.check_replicas_every=often"], "trainer.check_replicas_every: Value 'often'"),
    (["+cluster=9x9"], "cluster="),
    (["comm.inter_compression=int8"], "comm.inter_compression='int8' is not one of none, bf16, fp16"),
    (["trainer.precision=fp16"], "trainer.precision='fp16' is not one of fp32, bf16"),
    (["trainer.grad_clip_norm=-1"], "trainer.grad_clip_norm=-1.0 must be >= 0"),
    (["comm.find_unused_parameters=maybe"], "comm.find_unused_parameters: Value 'maybe' is not a valid bool"),
    (["cluster.testbed.link_mbit=[500,100,100]"],
     "cluster.testbed.link_mbit=[500, 100, 100] must be a rate > 0 (Mbit/s) or a list of 2 such rates, one per node"),
    (["cluster.testbed.link_mbit=fast"], "cluster.testbed.link_mbit='fast' must be a rate > 0"),
    (["cluster.testbed.nics_per_node=0"], "cluster.testbed.nics_per_node=0 must be in 1..8"),
    (["cluster.min_nnodes=3"], "cluster.min_nnodes=3 must be in 1..cluster.nnodes=2 (0: all nodes are needed)"),
    (["cluster.min_nnodes=1", "cluster.max_restarts=0"],
     "cluster.min_nnodes=1 < cluster.nnodes=2 needs cluster.max_restarts >= 1"),
    (["cluster.recovery=live"], "cluster.recovery='live' is not one of restart, in_place"),
    (["cluster.recovery=in_place"], "cluster.recovery=in_place needs an elastic job: cluster.min_nnodes=0 must be in 1..1"),
    (["cluster.recovery=in_place", "cluster.min_nnodes=1", "comm=ddp", "comm.shard_optimizer=true"],
     "cluster.recovery=in_place is not available with comm=ddp and comm.shard_optimizer=true: torch's"),
    (["trainer.elastic_lr=double"], "trainer.elastic_lr='double' is not one of keep, scale"),
    (["trainer.timeline_steps=[5,3]"], "trainer.timeline_steps=[5, 3] must be [first, last]: steps, 1 <= first <= last"),
    (["trainer.straggler_steps=0"], "trainer.straggler_steps=0 must be >= 1"),
    (["cluster.testbed.cpu_quota=[1,0.25,1]"], "cluster.testbed.cpu_quota=[1, 0.25, 1] must be a number of CPUs in"),
    (["cluster.testbed.cpu_quota=0.5"], "cluster.testbed.cpu_quota=0.5 limits the testbed's nodes: set "
                                        "cluster.testbed.enabled=true too"),
    (["comm=flat", "comm.inter_compression=bf16"],
     "comm.inter_compression='bf16' compresses the inter-node phase of hierarchical and sharded (and auto's choices of them); comm=flat has none"),
    (["comm=diloco", "comm.sync_every=0"], "comm.sync_every=0 must be >= 1 (inner steps between syncs)"),
    (["comm=diloco", "comm.fragments=3"], "comm.fragments=3 must divide comm.sync_every=32"),
    (["comm=diloco", "comm.inter=ring"], "comm.inter='ring' is not one of auto, hierarchical, sharded"),
    (["comm=diloco", "comm.inter_compression=int4"], "comm.inter_compression='int4' is not one of none, bf16, fp16, fp8"),
    (["comm=diloco", "comm.outer_optim._partial_=false"], "comm.outer_optim._partial_=False: the outer optimizer is"),
    (["comm=diloco", "comm.outer_optim._target_=torch.nn.Linear"],
     "comm.outer_optim._target_=torch.nn.Linear is not a torch.optim.Optimizer class"),
    (["comm=diloco", "comm.outer_optim.lr=fast"], "comm.outer_optim.lr='fast' is not a number"),
    (["comm=diloco", "cluster.intra_mode=thread"], "comm=diloco is not available with cluster.intra_mode=thread"),
    (["comm=hierarchical", "comm.sync_every=8"], "comm.sync_every=8 applies to comm=diloco only"),
    (["comm=diloco", "comm.fragments=4", "comm.overlap=true", "comm.overlap_steps=9"],
     "comm.overlap_steps=9 must be in 1..8 (comm.sync_every / comm.fragments"),
    (["comm=flat", "comm.shard_optimizer=true"], "comm.shard_optimizer=true is not available with comm=flat, which has "
                                                  "no intra-node phase"),
    (["comm=hsdp", "comm.shard_optimizer=true"], "with comm=hsdp, which shards the optimizer already"),
    (["trainer.compile=true", "comm.bucket_mb=0.5"], "torch's DDPOptimizer splits the compiled graph at DDP's buckets, which must be at "
                               "least DDP's first bucket (1 MiB): comm.bucket_mb=0.5 must be >= 1"),
    (["trainer.compile=true", "comm=hsdp", "comm.bucket_mb=25"], "comm=hsdp runs torch FSDP2, not DDP"),
    (["trainer.compile=true", "cluster.intra_mode=thread"], "cluster.intra_mode=thread runs no DDP"),
    (["comm=sharded", "comm.shard_optimizer=yes_please"], "comm.shard_optimizer: Value 'yes_please' is not a valid bool"),
    (["comm=sharded", "comm.shard_optimizer=true", "comm.grad_as_bucket_view=false"],
     "comm.shard_optimizer=true gathers the updated parameters through DDP's gradient buckets: it needs "
     "comm.grad_as_bucket_view=true"),
    (["comm=hierarchical", "comm.shard_optimizer=true", "cluster.intra_mode=thread"],
     "cluster.intra_mode=thread runs one process per node: use cluster.intra_mode=process"),
    (["comm=ddp", "comm.shard_optimizer=true", "cluster.recovery=in_place", "cluster.min_nnodes=1",
      "cluster.nnodes=2"], "cluster.recovery=in_place is not available with comm=ddp and comm.shard_optimizer=true: "
                           "torch's ZeroRedundancyOptimizer shards the optimizer over every rank of the job"),
    (["comm=sharded", "comm.shard_optimizer=true", "optim._target_=torch.optim.Adafactor"],
     "optim._target_=torch.optim.Adafactor cannot be sharded by comm.shard_optimizer: its second moment is "
     "factored"),
    (["comm=sharded", "comm.shard_optimizer=true", "optim._target_=torch.optim.LBFGS"],
     "cannot be sharded by comm.shard_optimizer: it takes a closure"),
    (["comm=hierarchical", "comm.inter_compression=fp8"],
     "comm.inter_compression='fp8' is not one of none, bf16, fp16 (fp8 is comm=diloco's)"),
]


@pytest.mark.multiprocess
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path):
    """The whole path once, as a user runs it; the other cases below go through the same precheck in-process."""
    start = time.monotonic()
    out = hybrid_train("comm=ring", cwd=tmp_path, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: comm='ring' is not one of adaptive, auto, ddp, diloco, flat, hierarchical, hsdp, sharded"]
    assert time.monotonic() - start < 30
    assert list(tmp_path.iterdir()) == []


@pytest.mark.unit
@pytest.mark.parametrize("args,needle", BAD)
def test_every_bad_input_is_named_in_one_line_and_writes_nothing(args, needle, tmp_path, monkeypatch):
    from hybrid.app.checks import precheck

    monkeypatch.chdir(tmp_path)
    error = precheck(list(args))
    assert error is not None and needle in error and "\n" not in error, error
    assert list(tmp_path.iterdir()) == []


def _bad_files(where: Path) -> dict[str, tuple[list[str], str]]:
    import numpy as np

    where.mkdir(exist_ok=True)
    y = np.zeros(8, dtype=np.int64)
    np.save(where / "y.npy", y)
    np.save(where / "x3d.npy", np.zeros((8, 2, 2), dtype=np.float32))
    np.save(where / "xint.npy", np.zeros((8, 4), dtype=np.int32))
    np.save(where / "empty.npy", np.zeros((0, 4), dtype=np.float32))
    np.save(where / "yfloat.npy", np.zeros(8, dtype=np.float32))
    np.save(where / "xok.npy", np.zeros((8, 4), dtype=np.float32))
    (where / "junk.npy").write_bytes(b"not numpy at all")
    files = lambda x, t="y.npy": ["data=files", f"data.inputs={where / x}", f"data.targets={where / t}"]  # noqa: E731
    return {
        "shape": (files("x3d.npy"), "inputs have shape (8, 2, 2); vectors are 2-D (with the samples)"),
        "dtype": (files("xint.npy"), "inputs have dtype int32; vectors need floating-point values"),
        "empty": (files("empty.npy", "empty.npy"), "has 0 samples"),
        "targets": (files("xok.npy", "yfloat.npy"), "targets have dtype float32; class ids must be integers"),
        "unreadable": (files("junk.npy"), "junk.npy' cannot be read as .npy"),
    }


@pytest.mark.unit
@pytest.mark.parametrize("case", ["shape", "dtype", "empty", "targets", "unreadable"])
def test_bad_data_files_are_one_line_and_write_nothing(case, tmp_path_factory, monkeypatch):
    from hybrid.app.checks import precheck

    args, needle = _bad_files(tmp_path_factory.mktemp("files"))[case]
    cwd = tmp_path_factory.mktemp("cwd")
    monkeypatch.chdir(cwd)
    error = precheck(args)
    assert error is not None and needle in error and "\n" not in error, error
    assert list(cwd.iterdir()) == []


@pytest.mark.multiprocess
@pytest.mark.background  # four small runs, mostly start-up: beside the main lane
def test_a_sweeps_runs_are_named_by_their_overrides_in_tensorboard_and_a_resume_of_another_model_is_refused(
        tmp_path):
    """One small sweep (two layouts) serves both: its runs' names as TensorBoard's own
    run discovery finds them, and the runs the refused resumes point at."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    sweep = tmp_path / "sweep"
    first = hybrid_train("-m", *SMALL, "cluster=1x2,2x1", "comm=hierarchical,diloco", f"data.root={tmp_path / 'data'}",
                         f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    multiplexer = EventMultiplexer().AddRunsFromDirectory(str(sweep))
    multiplexer.Reload()
    names = sorted(multiplexer.Runs())
    assert [n.split("_")[0] for n in names] == ["00", "01", "02", "03"], names  # in launch order, unique
    for name in names:
        job, tb = name.split("/")
        metrics = json.loads((sweep / job / "metrics.json").read_text())
        # Named by what the sweep varies, not by the overrides every job shares (data.root, the SMALL keys).
        assert tb == "tb" and job == (f"{job[:2]}_cluster:{metrics['nnodes']}x{metrics['nproc_per_node']}"
                                      f"+comm:{metrics['comm']}"), name
        # comm=diloco's outer loop in TensorBoard: its one sync (H=32 > 6 steps: the final one) at the last step,
        # with rank 0's loss of that step.
        diloco = {tag: multiplexer.Scalars(name, tag) for tag in multiplexer.GetAccumulator(name).Tags()["scalars"]
                  if tag.startswith("diloco/")}
        if metrics["comm"] == "diloco":
            assert metrics["diloco"]["outer_steps"] == 1 and metrics["param_checksums_identical"]
            assert [(e.step, e.value) for e in diloco["diloco/outer_steps"]] == [(6, 1.0)], name
            assert set(diloco) == {"diloco/outer_steps", "diloco/pseudo_grad_norm", "diloco/loss_before_sync"}
        else:
            assert diloco == {}, name
    assert {json.loads((sweep / n.split("/")[0] / "metrics.json").read_text())["nnodes"] for n in names} == {1, 2}
    # The report reads these real runs: a headline per shape, and no inf or nan anywhere in it.
    from hybrid.tools.report import main as report

    assert report([str(sweep)]) == 0
    text = (sweep / "report.md").read_text()
    headlines = [line for line in text.splitlines() if line.startswith("- **")]
    assert [h.split(",")[0] for h in headlines] == ["- **1x2", "- **2x1"], headlines
    assert not re.search(r"\b(inf|nan)\b", text, re.IGNORECASE), text
    run = sweep / names[0].split("/")[0]  # passed below as trainer.resume=<it>, unquoted
    (tmp_path / "plain").mkdir()
    for args, needle in (
        (["trainer.resume=" + str(tmp_path / "plain")], "has no checkpoints/last.pt (not a finished or checkpointed"),
        ([*SMALL[:-1], "model.width=48", f"trainer.resume={run}"],
         "holds a different model: model.width=32 there, 48 here"),
    ):
        cwd = tmp_path / f"cwd-{len(needle)}"
        cwd.mkdir()
        out = hybrid_train(*args, cwd=cwd, timeout=60)
        assert out.returncode == 2 and needle in out.stderr, out.stderr[-2000:]
        assert len(out.stderr.strip().splitlines()) == 1
        assert [p.name for p in cwd.iterdir()] in ([], ["data"])  # at most the (shared) synthetic data


@pytest.mark.multiprocess
def test_help_lists_the_config_groups(tmp_path):
    out = hybrid_train("--help", cwd=tmp_path, timeout=60)
    assert out.returncode == 0
    for line in ("cluster: 1x2, 1x4, 2x1, 2x2, 2x4, 4x1, 4x2, local", "comm: adaptive, auto, ddp, diloco, flat, hierarchical, hsdp, sharded",
                 "model: cnn, gpt2, mlp, transformer", "data: files, synthetic, text", "optim: adamw, sgd", "trainer: default",
                 "experiment: adaptive, auto_vs_fixed, diloco, flat_vs_hier, flat_vs_hier_small"):
        assert line in out.stdout
    # It opens with what hybrid is, not Hydra's stock header, and says where the docs are.
    assert out.stdout.startswith("hybrid: data-parallel PyTorch training"), out.stdout[:200]
    assert "powered by Hydra" not in out.stdout and "docs/training.md" in out.stdout
    # Every config group it lists is explained above the listing, the ones to pick first in order.
    intro = out.stdout.split("== All config groups ==")[0]
    groups = sorted(d.name for d in (Path(__file__).parents[1] / "conf").iterdir() if d.is_dir() and d.name != "hydra")
    assert all(re.search(rf"\b{group}\b", intro) for group in groups), groups
    first = [line.split()[0] for line in intro.split("(GROUP=OPTION):")[1].splitlines()[1:] if line.startswith("  ")
             and not line.startswith("   ")]
    assert first == ["cluster", "comm", "model", "data", "optim", "trainer"], first


@pytest.mark.unit
def test_more_gpu_workers_than_gpus_is_refused(monkeypatch):
    import torch

    from hybrid.app.checks import check_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cfg = compose_train_config([])
    with pytest.raises(ValueError, match=r"cluster.nproc_per_node=2 but this node has 1 GPU\(s\)"):
        check_devices(cfg)


@pytest.mark.multiprocess
def test_an_earlier_run_dir_is_never_overwritten(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.json").write_text("precious")
    out = hybrid_train(f"hydra.run.dir={run}", *SMALL, cwd=tmp_path, timeout=60)
    assert out.returncode == 2 and "already holds a run" in out.stderr
    assert (run / "metrics.json").read_text() == "precious"
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "metrics.json"]


@pytest.mark.multiprocess
@pytest.mark.background  # mostly start-up (two agents, four workers): beside the main lane
def test_under_real_torchrun_two_agents_2x2_hierarchical(tmp_path):
    run = tmp_path / "run"
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=hybrid-test",
           "--max-restarts=0", "-m", "hybrid.train", "comm=hierarchical", f"hydra.run.dir={run}", *SMALL]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    agents = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True) for _ in range(2)]
    try:
        outputs = [a.communicate(timeout=240)[0] for a in agents]
    finally:
        for a in agents:
            a.kill()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["nnodes"] == 2 and metrics["nproc_per_node"] == 2 and metrics["world_size"] == 4
    assert metrics["comm"] == "hierarchical" and metrics["param_checksums_identical"]
    # Rank 0 owns the run dir; the other ranks wrote nothing of Hydra's anywhere.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "run"]


@pytest.mark.multiprocess
def test_under_torchrun_an_elastic_run_needs_a_fixed_run_dir_and_a_restart_continues_it(monkeypatch, tmp_path):
    """A torchrun restart re-runs main(): rank 0 must find this run's directory (not a new timestamped one) and
    must not refuse it for holding a run: it is the run being continued."""
    from hybrid.app.checks import precheck

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    elastic = ["cluster.min_nnodes=1", "cluster.max_restarts=1", "model.width=16", f"data.root={tmp_path / 'data'}"]
    assert "needs hydra.run.dir" in precheck(elastic)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step-00000005.pt").write_bytes(b"x")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert "already holds a run" in precheck([*elastic, "hydra.run.dir=run"])
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert precheck([*elastic, "hydra.run.dir=run"]) is None


@pytest.mark.multiprocess
def test_torchrun_layout_conflicting_with_cluster_override_is_an_error(monkeypatch):
    from hybrid.app.checks import check_torchrun_layout

    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = compose_train_config([])
    cfg.cluster.nnodes = 3
    with pytest.raises(ValueError, match=r"cluster.nnodes=3 conflicts with torchrun's nnodes \(2\)"):
        check_torchrun_layout(cfg, ["cluster.nnodes=3"])
    check_torchrun_layout(cfg, [])  # not overridden: torchrun's layout wins silently
    # Elastic (--nnodes 2:3, cluster.min_nnodes=2): after a node is lost torchrun restarts with 2 nodes.
    cfg.cluster.min_nnodes = 2
    check_torchrun_layout(cfg, ["cluster.nnodes=3"])
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    with pytest.raises(ValueError, match=r"cluster.nnodes=3 conflicts with torchrun's nnodes \(1\)"):
        check_torchrun_layout(cfg, ["cluster.nnodes=3"])
