"""A user's own model, data, loss and optimizer through Hydra ``_target_`` and ``--config-dir``.

The package and configs are the worked example of docs/your-model.md, read from
that page itself; the 2x2 parity and resume runs of it are in tests/test_trainer.py.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.app.checks import precheck

from helpers.readme_example import write_example

# Things that go wrong in a user's package, each built the way a user would write it.
BAD_PACKAGE = '''
import torch
from torch import nn
from torch.utils.data import Dataset


class Exploding(nn.Module):
    def __init__(self, features, classes):
        super().__init__()
        raise RuntimeError("cannot build: the GPU kernel is missing")


class AllFrozen(nn.Linear):
    def __init__(self, features, classes):
        super().__init__(features, classes)
        self.requires_grad_(False)


class Triples(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.zeros(8), torch.tensor(0), torch.tensor(1)


def not_a_dataset():
    return 42


def per_sample_loss(output, target):
    return nn.functional.cross_entropy(output, target, reduction="none")
'''


@pytest.fixture()
def example(tmp_path, monkeypatch) -> Path:
    """docs/your-model.md's example files under tmp_path, plus ``badpkg``, importable as a user's packages are."""
    write_example(tmp_path)
    (tmp_path / "badpkg.py").write_text(BAD_PACKAGE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


MINE = ["--config-dir", "myconf", "model=mynet", "data=spirals", "loss=smoothed"]
BAD = [
    # (overrides after MINE, what the one line must hold)
    (["model._target_=nope.Net"], "model._target_=nope.Net cannot be imported (no module named 'nope')"),
    # With data=synthetic (kind auto), what the model takes is asked next: the missing module is still named first.
    (["model._target_=nope.Net", "data=synthetic"], "model._target_=nope.Net cannot be imported (no module named "
                                                    "'nope')"),
    (["model._target_=mypkg.NoSuchNet", "data=synthetic"], "model._target_=mypkg.NoSuchNet cannot be imported "
                                                           "(mypkg has no attribute 'NoSuchNet')"),
    (["~model.hidden"], "model._target_=mypkg.MyNet: TypeError: MyNet.__init__() missing 1 required positional "
                        "argument: 'hidden'"),
    (["+model.dropout=0.1"], "model._target_=mypkg.MyNet: TypeError: MyNet.__init__() got an unexpected keyword "
                             "argument 'dropout'"),
    (["model._target_=badpkg.Exploding", "~model.hidden"],
     "model._target_=badpkg.Exploding: RuntimeError: cannot build: the GPU kernel is missing"),
    (["model._target_=collections.OrderedDict", "~model.hidden", "~model.features", "~model.classes"],
     "model._target_=collections.OrderedDict gave a OrderedDict, not a torch.nn.Module"),
    (["model.features=5"], "model=mynet with loss=smoothed_cross_entropy cannot train on data=spirals (a batch of "
                           "(2, 8) float32 inputs, (2,) int64 targets): RuntimeError: mat1 and mat2 shapes cannot "
                           "be multiplied"),
    (["model._target_=badpkg.AllFrozen", "~model.hidden"], "model._target_=badpkg.AllFrozen has no trainable "
                                                           "parameters"),
    (["data._target_=badpkg.not_a_dataset", "~data.num_samples", "~data.features", "~data.classes",
      "model.features=8", "model.classes=3"],
     "data._target_=badpkg.not_a_dataset gave a int, not a map-style torch.utils.data.Dataset"),
    (["data._target_=badpkg.Triples", "~data.num_samples", "~data.features", "~data.classes", "model.features=8",
      "model.classes=3"], "data._target_=badpkg.Triples: a sample is a tuple, not an (input, target) pair"),
    (["loss._target_=badpkg.per_sample_loss", "~loss.smoothing"],
     "loss._target_=badpkg.per_sample_loss gave (2,) float32: the loss must be a floating-point scalar tensor"),
    (["~optim._partial_"], "optim._partial_=None: an optimizer is built with the model's parameters, so its node "
                           "needs _partial_: true"),
    (["model=nosuch"], "model='nosuch' is not one of cnn, gpt2, mlp, mynet, transformer"),
    (["model=mlp", "data=text"], "data=text is next-byte prediction for a language model: model=mlp cannot train"),
    (["~data.features"], "model.features: Interpolation key 'data.features' not found"),
]


@pytest.mark.unit
@pytest.mark.parametrize("overrides, line", BAD, ids=[str(i) for i in range(len(BAD))])
def test_a_bad_component_is_one_line_naming_it_exit_2_and_nothing_written(example, overrides, line, monkeypatch,
                                                                           capsys):
    """``python -m hybrid.train``'s own entry point, in this process: the error line, exit code 2, and no file
    added to the directory (no run dir, no generated data)."""
    from hybrid.app.train import main

    before = sorted(p.relative_to(example) for p in example.rglob("*") if "__pycache__" not in p.parts)
    monkeypatch.setattr(sys, "argv", ["hybrid.train", *MINE, *overrides, "hydra.run.dir=runs/bad"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and error.startswith(f"error: {line}"), error
    assert sorted(p.relative_to(example) for p in example.rglob("*") if "__pycache__" not in p.parts) == before


@pytest.mark.unit
def test_a_config_dir_that_does_not_exist_is_one_line(example):
    assert precheck(["--config-dir", "nosuch", "model=mynet"]) == "--config-dir 'nosuch' does not exist or is not a directory"


def hybrid_train(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybrid.train", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.multiprocess
def test_a_bad_component_exits_2_before_anything_is_written(example):
    out = hybrid_train(*MINE, "model._target_=mypkg.Nope", "hydra.run.dir=runs/bad", cwd=example, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        "error: model._target_=mypkg.Nope cannot be imported (mypkg has no attribute 'Nope'): give the import path "
        "of a class or function, with its package on PYTHONPATH"]
    assert not (example / "runs").exists()


@pytest.mark.multiprocess
@pytest.mark.background  # one small run, mostly start-up: beside the main lane
def test_the_readme_example_runs_verbatim(tmp_path):
    """The worked example's files and command (docs/your-model.md), as a reader copies them into an empty directory."""
    command = write_example(tmp_path)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = json.loads((tmp_path / "runs" / "mine" / "metrics.json").read_text())
    assert (metrics["model"], metrics["world_size"], metrics["steps"]) == ("mynet", 4, 40)
    assert metrics["param_checksums_identical"]
    assert metrics["final_loss"] < math.log(3)  # below a uniform guess over the three spirals


@pytest.mark.multiprocess
@pytest.mark.background  # two small jobs and the report, mostly start-up: beside the main lane
def test_a_sweep_over_a_users_model_and_a_built_in_one(tmp_path):
    """``-m model=mynet,mlp`` on the user's data: both jobs run, and the report tells them apart."""
    write_example(tmp_path)
    example = tmp_path
    out = hybrid_train("-m", *[a for a in MINE if a != "model=mynet"], "model=mynet,mlp", "cluster.nnodes=1",
                       "cluster.nproc_per_node=2",
                       "trainer.max_steps=4", "hydra.sweep.dir=sweep", cwd=example)
    assert out.returncode == 0, out.stderr[-3000:]
    models = sorted(json.loads(p.read_text())["model"] for p in (example / "sweep").glob("*/metrics.json"))
    assert models == ["mlp", "mynet"]
    report = subprocess.run([sys.executable, "-m", "hybrid.report", "sweep"], cwd=example, capture_output=True,
                            text=True, timeout=120)
    assert report.returncode == 0, report.stderr[-2000:]
    assert "mynet" in report.stdout and "mlp w256 d4" in report.stdout


LM_PACKAGE = '''
import torch
from torch.utils.data import Dataset


class Windows(Dataset):
    """Token windows given as Hugging Face models take them: a dict with input_ids and labels."""

    def __init__(self, num_samples, seq_len, vocab_size):
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, vocab_size, (num_samples, 1), generator=g)
        self.ids = (start + torch.arange(seq_len)) % vocab_size  # learnable: each token is the last plus one

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}, torch.tensor(0)
'''
HF_MODEL = '''_target_: transformers.GPT2LMHeadModel
config:
  _target_: transformers.GPT2Config
  vocab_size: ${data.vocab_size}
  n_positions: ${data.seq_len}
  n_embd: 32
  n_layer: 1
  n_head: 2
'''
WINDOWS = '''_target_: lmpkg.Windows
num_samples: 512
seq_len: 16
vocab_size: 32
batch_size: 8
'''


@pytest.mark.multiprocess
@pytest.mark.background  # one small run, mostly start-up (transformers' imports): beside the main lane
def test_a_hugging_face_model_with_its_own_loss_and_dict_inputs(tmp_path):
    """transformers' GPT2LMHeadModel named directly (its GPT2Config built by Hydra's recursive instantiate),
    fed dicts of input_ids and labels: its output's own .loss is what trains (the default cross-entropy could
    not take that output), on 1x2 with flat, and the loss falls from ln 32."""
    (tmp_path / "lmpkg.py").write_text(LM_PACKAGE)
    for name, text in (("model/hf.yaml", HF_MODEL), ("data/windows.yaml", WINDOWS)):
        (tmp_path / "conf" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "conf" / name).write_text(text)
    out = hybrid_train("--config-dir", "conf", "model=hf", "data=windows", "optim=adamw", "optim.lr=0.01",
                       "comm=flat", "cluster.nnodes=1", "cluster.nproc_per_node=2", "trainer.max_steps=30",
                       "hydra.run.dir=run", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["model"] == "gpt2lmheadmodel" and metrics["param_checksums_identical"]
    assert metrics["final_loss"] < 0.5 * math.log(32), metrics["final_loss"]


@pytest.mark.multiprocess
@pytest.mark.background  # one small benchmark, mostly start-up: beside the main lane
def test_the_train_benchmark_compares_comms_on_a_users_own_model(tmp_path):
    """``python -m hybrid.bench train --config-dir``: the flat-vs-hierarchical comparison on one's own parts."""
    write_example(tmp_path)
    example = tmp_path
    out = subprocess.run([sys.executable, "-m", "hybrid.bench", "train", "--layouts", "1x2", "--comms",
                          "ddp,hierarchical", "--steps", "3", "--rounds", "1", "--config-dir", "myconf",
                          "--output", "bench.json", "model=mynet", "data=spirals", "loss=smoothed"],
                         cwd=example, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((example / "bench.json").read_text())
    assert {(r["layout"], r["comm"]) for r in report["summary"]} == {("1x2", "ddp"), ("1x2", "hierarchical")}
    # The worked example's model counted apart, in the user's directory (this lane leaves sys.path alone).
    counted = subprocess.run([sys.executable, "-c", _COUNT_MYNET], cwd=example, capture_output=True, text=True,
                             timeout=120)
    assert counted.returncode == 0, counted.stderr[-2000:]
    assert report["param_bytes"] == int(counted.stdout)  # trainable parameters (tied head counted once)
    bad = subprocess.run([sys.executable, "-m", "hybrid.bench", "train", "--config-dir", "nosuch", "model=mynet"],
                         cwd=example, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--config-dir 'nosuch' does not exist or is not a directory" in bad.stderr


_COUNT_MYNET = """
from mypkg import MyNet
model = MyNet(features=8, hidden=32, classes=3)
print(sum(p.numel() * 4 for n, p in model.named_parameters() if n not in ("project.weight", "project.bias")))
"""
