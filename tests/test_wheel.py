"""hybrid installs like any library: a wheel, into a fresh venv, runs from a directory that is not the repository.

The wheel is built from this checkout and installed with ``--no-deps`` into a
new venv; its dependencies (torch, Hydra, ...) come from the test
environment's site-packages through a ``.pth`` path entry, which does not
carry the editable install of hybrid along (an editable install is what
hid the bug this guards against: conf/ was not shipped, and
``python -m hybrid.train`` outside the repository failed with "Primary
config directory not found").
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.packaging

REPO = Path(__file__).resolve().parent.parent
TINY = ["cluster.nnodes=1", "cluster.nproc_per_node=1", "trainer.max_steps=2", "trainer.log_every=1", "data.num_samples=256", "model.width=16"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the fresh venv's python, an empty working directory)."""
    root = tmp_path_factory.mktemp("wheel")
    # From a copy without build outputs: setuptools reuses build/lib, whose stale files would go into the wheel.
    source = root / "source"
    skipped = {".git", ".venv", "build", "hybrid.egg-info", "outputs", "multirun", "runs", "data", ".pytest_cache"}
    shutil.copytree(REPO, source, ignore=lambda folder, names: [
        n for n in names if n == "__pycache__" or (Path(folder) == REPO and n in skipped)])
    dist = root / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(source)],
                   check=True, timeout=240, capture_output=True)
    (wheel,) = dist.glob("hybrid-*.whl")
    env_dir = root / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    Path(purelib, "test-dependencies.pth").write_text("\n".join(deps) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, timeout=240, capture_output=True)
    workdir = root / "elsewhere"
    workdir.mkdir()
    return python, workdir


def _run(python: Path, args: list[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    return subprocess.run([str(python), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def test_the_installed_package_is_the_wheel_not_the_checkout(installed):
    python, workdir = installed
    out = _run(python, ["-c", "import hybrid, hybrid.app.config as c; print(hybrid.__file__); print(c.packaged_conf_dir())"],
               workdir)
    assert out.returncode == 0, out.stderr
    package_file, conf_dir = out.stdout.split()
    assert str(REPO) not in package_file and "site-packages" in package_file
    assert Path(conf_dir, "config.yaml").is_file() and Path(conf_dir, "comm", "hierarchical.yaml").is_file()


def test_two_steps_from_an_empty_directory_write_the_run(installed):
    python, workdir = installed
    run = workdir / "run"
    out = _run(python, ["-m", "hybrid.train", *TINY, f"hydra.run.dir={run}", f"data.root={workdir / 'data'}"], workdir)
    assert out.returncode == 0, out.stderr[-2000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["steps_run"] == 2 and metrics["param_checksums_identical"]
    assert (run / ".hydra" / "config.yaml").is_file() and (run / "tb").is_dir()


def test_the_console_script_shows_the_config_groups(installed):
    python, workdir = installed
    out = subprocess.run([str(python.parent / "hybrid-train"), "--help"], cwd=workdir, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "comm: adaptive, auto, ddp, diloco, flat, hierarchical, hsdp, sharded" in out.stdout


def test_a_sweep_and_a_users_config_dir_work_from_anywhere(installed):
    python, workdir = installed
    mine = workdir / "myconf" / "model"
    mine.mkdir(parents=True)
    (mine / "tiny.yaml").write_text("_target_: hybrid.app.components.models.MLP\nin_features: ${data.features}\nwidth: 8\n"
                                     "depth: 2\nclasses: ${data.classes}\n")
    sweep = workdir / "sweep"
    out = _run(python, ["-m", "hybrid.train", "-m", "--config-dir", str(workdir / "myconf"), "model=tiny", "comm=flat,ddp",
                        *TINY[:-1], f"hydra.sweep.dir={sweep}", f"data.root={workdir / 'data'}"], workdir, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    runs = sorted(sweep.glob("*/metrics.json"))
    assert len(runs) == 2
    assert {json.loads(p.read_text())["comm"] for p in runs} == {"flat", "ddp"}
    # The user's model config (from --config-dir) is the one that ran.
    assert all("width: 8" in (p.parent / ".hydra" / "config.yaml").read_text() for p in runs)
