"""Every config in conf/ composes against the typed schema and turns into validated settings."""

from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import hybrid.app.train  # noqa: F401  registers the schema (train_schema) with Hydra's ConfigStore
from hybrid.app.checks import check_components
from hybrid.app.config import COMM_ALGORITHMS, CommConfig, TrainConfig, validate

pytestmark = pytest.mark.unit

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = {g.name: sorted(p.stem for p in g.glob("*.yaml")) for g in CONF.iterdir() if g.is_dir()}


def compose_with(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_group_option_composes_into_typed_settings_and_builds(group, option, tmp_path):
    extra = ([f"data.root={tmp_path}", "data.num_samples=64"] if group not in ("data", "experiment", "peer_model")
             or option == "synthetic" else [])
    if (group, option) == ("data", "files"):
        np.save(tmp_path / "x.npy", np.zeros((8, 64), np.float32))
        np.save(tmp_path / "y.npy", np.arange(8) % 10)
        extra = [f"data.inputs={tmp_path / 'x.npy'}", f"data.targets={tmp_path / 'y.npy'}"]
    if (group, option) == ("data", "text"):
        extra = ["model=transformer"]  # next-byte text is for language models (mlp refuses it in one line)
    if (group, option) == ("model", "gpt2"):
        extra += ["model.width=16", "model.depth=1"]
    # experiment/ and peers' groups are not in the defaults list: they are added with +experiment=... (+peer=...)
    added = group in ("experiment", "peer", "peer_model")
    prefix = "+" if added else ""
    settings = validate(OmegaConf.to_object(compose_with(f"{prefix}{group}={option}", *extra)))
    assert isinstance(settings, TrainConfig)
    if group not in ("experiment", "peer_model"):  # sweeps and big models: composing them is the check here
        check_components(settings)  # every part builds, and two samples go through model and loss


def test_the_groups_the_docs_promise_exist():
    assert {"cluster", "comm", "model", "data", "loss", "optim", "trainer"} <= set(GROUPS)
    assert GROUPS["comm"] == sorted(COMM_ALGORITHMS)
    assert {"mlp", "cnn", "transformer", "gpt2"} <= set(GROUPS["model"])
    assert {"synthetic", "files", "text"} <= set(GROUPS["data"])


@pytest.mark.parametrize("choice", COMM_ALGORITHMS)
def test_each_comm_config_is_valid_comm_settings(choice):
    cfg = compose_with(f"comm={choice}")
    settings = CommConfig(**OmegaConf.to_container(cfg.comm, resolve=True))
    assert settings.algorithm == choice


def test_stable_names_scripts_rely_on():
    cfg = compose_with("cluster.nnodes=3", "cluster.nproc_per_node=2", "comm.bucket_mb=4", "trainer.max_steps=7",
                       "trainer.seed=3", "trainer.checkpoint_every=2", "trainer.resume=true", "data.batch_size=8",
                       "model.width=16", "model.depth=2")
    s = validate(OmegaConf.to_object(cfg))
    assert (s.cluster.nnodes, s.cluster.nproc_per_node, s.comm.bucket_mb, s.trainer.max_steps) == (3, 2, 4.0, 7)
    assert (s.trainer.seed, s.trainer.checkpoint_every, s.trainer.resume, s.data.batch_size) == (3, 2, True, 8)
    assert (s.model.get("width"), s.model.get("depth")) == (16, 2)


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("algorithm", "ring", "'ring' is not one of flat, hierarchical, sharded, auto, ddp"),
        ("intra_backend", "mpi", "comm.intra_backend='mpi' is not one of auto, gloo, nccl"),
        ("bucket_mb", 0, "comm.bucket_mb=0 must be > 0"),
        ("timeout_s", -1, "comm.timeout_s=-1 must be > 0"),
    ],
)
def test_bad_comm_settings_name_the_value_and_what_is_allowed(field, value, needle):
    with pytest.raises(ValueError) as err:
        CommConfig(**{field: value})
    assert needle in str(err.value)


def test_a_built_in_components_label_is_its_config_name():
    """metrics.json, TensorBoard and the report name a run's parts by their _target_ (lower case): for the
    shipped ones that is the name users pick them by."""
    from hybrid.app.targets import label_of

    for group in ("model", "data", "loss", "optim"):
        for option in GROUPS[group]:
            target = OmegaConf.load(CONF / group / f"{option}.yaml")["_target_"]
            assert label_of(target) == option, (group, option, target)


@pytest.mark.parametrize("model,loss,data", [
    ("hybrid.app.models.MLP", "hybrid.app.losses.cross_entropy", "hybrid.app.datasets.synthetic"),
    ("hybrid.app.models.Transformer", "hybrid.app.losses.cross_entropy", "hybrid.app.datasets.text"),
])
def test_a_config_naming_the_former_module_paths_still_builds(model, loss, data, tmp_path):
    """Configs and sweeps that name the built-in components directly under hybrid.app (hybrid.app.models.MLP
    and friends) compose, pair (a text model with data=text) and build as the names under hybrid.app.components."""
    text = data.endswith("text")
    where = [] if text else [f"data.root={tmp_path}", "data.num_samples=64"]
    cfg = compose_with("data=text" if text else "data=synthetic", "model=transformer" if text else "model=mlp",
                       f"model._target_={model}", f"loss._target_={loss}",
                       f"data._target_={data}", *where, "model.width=16", "model.depth=1")
    settings = validate(OmegaConf.to_object(cfg))
    assert settings.model.target == model.replace("hybrid.app.", "hybrid.app.components.")
    assert settings.loss.target == loss.replace("hybrid.app.", "hybrid.app.components.")
    check_components(settings)


def test_a_checkpoint_naming_a_former_model_path_resumes_and_another_model_does_not(tmp_path):
    from hybrid.app.replicas.base import PlainState
    from hybrid.app.setup import _check_resumable
    from hybrid.app.targets import Component

    model = Component("model", "hybrid.app.components.models.MLP", {"width": 16})
    _check_resumable({"model_config": {"_target_": "hybrid.app.models.MLP", "width": 16}}, model, tmp_path, PlainState.kind)
    with pytest.raises(ValueError, match="holds model"):
        _check_resumable({"model_config": {"_target_": "hybrid.app.models.CNN", "width": 16}}, model, tmp_path, PlainState.kind)
