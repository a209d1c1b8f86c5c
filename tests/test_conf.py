"""The Hydra config: every option of every group composes, names real classes with real arguments, and is documented."""

import copy
import functools
import importlib
import inspect
import os

import lightning_seqmem.conf
import pytest
import yaml
from hydra import compose, initialize_config_module
from hydra.errors import MissingConfigException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lightning_seqmem.apps.train import DATAMODULE_TRAINER_KEYS, MIX_KEYS
from lightning_seqmem.batching.options import ALIASES, NAMES, Pack, Pad, Truncate, as_batching

CONF_DIR = os.path.dirname(lightning_seqmem.conf.__file__)
GROUPS = ("data", "batching", "model", "callbacks", "trainer", "logger", "experiment")


def options(group):
    return sorted(f[:-5] for f in os.listdir(os.path.join(CONF_DIR, group)) if f.endswith(".yaml"))


def yaml_files():
    for root, _, files in os.walk(CONF_DIR):
        for name in sorted(files):
            if name.endswith(".yaml"):
                yield os.path.relpath(os.path.join(root, name), CONF_DIR)


def compose_cfg(overrides=()):
    """The main job's config with ``overrides``, read-only: composed once per list of overrides (a compose reads
    and parses every YAML file again, ~0.2 s), the same object handed to every test that asks for it."""
    return _compose(tuple(overrides))


@pytest.fixture(scope="module", autouse=True)
def parse_each_yaml_once():
    """Each config file read and parsed once for this module's ~80 composes, a copy handed to each (Hydra caches
    them within one compose only; the parse was 40 % of a compose). The composing itself runs every time."""
    from hydra._internal.config_repository import ConfigRepository

    read, parsed = ConfigRepository.load_config, {}

    def load_config(self, config_path):
        key = (tuple(source.path for source in self.sources), config_path)
        if key not in parsed:
            parsed[key] = read(self, config_path)
        return copy.deepcopy(parsed[key])

    ConfigRepository.load_config = load_config
    yield
    ConfigRepository.load_config = read


@functools.cache
def _compose(overrides):
    with initialize_config_module("lightning_seqmem.conf", version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    OmegaConf.set_readonly(cfg, True)
    return cfg


def test_groups_mirror_the_concerns():
    assert set(options("data")) == {"builtin", "hf", "local", "chat", "preference", "mix"}  # where the data come from
    assert set(options("batching")) == set(NAMES) | set(ALIASES)  # how they are batched: the one vocabulary
    assert set(options("model")) >= {"tiny_llama", "tiny_gpt2", "local_path"}
    assert set(options("callbacks")) >= {"default", "seq_warmup", "preallocate", "memory_monitor", "checks", "summary"}
    assert set(options("trainer")) >= {"cpu", "gpu", "ddp", "ddp_spawn"}
    assert set(options("logger")) >= {"csv", "tensorboard"}
    assert "warmup_sweep" in options("experiment")


def _target_nodes(node, path=""):
    if isinstance(node, dict):
        if "_target_" in node:
            yield path, node
        for key, value in node.items():
            yield from _target_nodes(value, f"{path}.{key}" if path else str(key))


def _resolve(target):
    module, _, name = target.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes_and_its_targets_take_the_arguments(group, option):
    """Every option composes; every ``_target_`` exists and accepts the keys given (a renamed class or argument
    breaks this test, not a user's run)."""
    cfg = compose_cfg([f"{group}={option}"])
    assert cfg.data._target_ and cfg.model._target_ and cfg.trainer._target_
    node = cfg if group == "experiment" else cfg.data.batching if group == "batching" else cfg[group]
    node = OmegaConf.to_container(node, resolve=False)
    for path, entry in _target_nodes(node):
        params = inspect.signature(_resolve(entry["_target_"])).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            continue
        unknown = {k for k in entry if not k.startswith("_")} - set(params)
        if (group, option, path) == ("data", "mix", ""):
            unknown -= set(MIX_KEYS)  # read by data.dataset (a Mix) through interpolation; seqmem-train drops them
        if path == "trainer" or group == "trainer" and path == "":
            unknown -= set(DATAMODULE_TRAINER_KEYS)  # seqmem-train sets them on the DataModule
        assert not unknown, f"{group}={option}: {path} passes {sorted(unknown)} that {entry['_target_']} does not take"


def test_callbacks_one_file_per_callback_keyed_by_name():
    for name in options("callbacks"):
        data = yaml.safe_load(open(os.path.join(CONF_DIR, "callbacks", f"{name}.yaml"))) or {}
        if name in ("default", "none"):
            continue
        assert list(data) == [name], f"callbacks/{name}.yaml must hold one entry keyed {name!r}"
        assert "_target_" in data[name]
    default = compose_cfg().callbacks
    assert {"seq_warmup", "preallocate", "memory_monitor", "checks", "summary", "job_record"} <= set(default)
    assert default.seq_warmup.duration == 0.0  # off by default; sweeps vary it


def test_every_argument_has_a_comment():
    missing = []
    for rel in yaml_files():
        for number, line in enumerate(open(os.path.join(CONF_DIR, rel)), 1):
            stripped = line.strip()
            if not stripped or stripped.startswith(("#", "-")) or stripped.startswith("_target_"):
                continue
            key, _, value = stripped.partition(":")
            if value.strip() and "#" not in value and key not in ("defaults",):
                missing.append(f"{rel}:{number}: {stripped}")
    assert not missing, "arguments without a comment:\n" + "\n".join(missing)


@pytest.mark.parametrize("name", [*NAMES, *ALIASES])
def test_a_batching_name_means_one_thing_everywhere(name):
    """``batching=<name>`` (Hydra), ``strategy=<name>`` (Python, LightningCLI) and ``plan.strategies=[<name>]`` build
    the same object, and the planner's table prints it by that name."""
    from lightning_seqmem.apps.planner import check_strategies

    hydra = instantiate(compose_cfg([f"batching={name}"]).data.batching)
    assert hydra == as_batching(name) == check_strategies([name])[0]
    assert hydra.spelling == ALIASES.get(name, name) and as_batching(hydra.spelling) == hydra
    with initialize_config_module("lightning_seqmem.conf", version_base="1.3"):
        planned = compose("plan", overrides=[f"plan.strategies=[{name}]"]).plan.strategies
    assert check_strategies(instantiate(planned, _convert_="all")) == (hydra,)


def test_callbacks_switch_off_and_none():
    cfg = compose_cfg(["~callbacks.preallocate", "callbacks.memory_monitor=null"])
    assert "preallocate" not in cfg.callbacks and cfg.callbacks.memory_monitor is None
    assert not compose_cfg(["callbacks=none"]).callbacks


def test_both_loggers_and_experiment_preset():
    assert set(compose_cfg(["logger=[csv,tensorboard]"]).logger) == {"csv", "tensorboard"}
    cfg = compose_cfg(["experiment=warmup_sweep"])
    assert instantiate(cfg.data.batching) == Pack(method="bfd") and cfg.trainer.max_steps > 0
    with initialize_config_module("lightning_seqmem.conf", version_base="1.3"):
        hcfg = compose("config", overrides=["experiment=warmup_sweep"], return_hydra_config=True)
    assert "0.0" in str(hcfg.hydra.sweeper.params["callbacks.seq_warmup.duration"])


def test_warmup_length_follows_data():
    cfg = compose_cfg(["data.max_length=96"])
    assert cfg.callbacks.seq_warmup.max_seq_length == 96


def test_unknown_option_lists_the_valid_ones():
    with pytest.raises(MissingConfigException) as err:
        compose_cfg(["data=nope"])
    message = str(err.value)
    assert "nope" in message and all(o in message for o in ("builtin", "local", "chat"))
    with pytest.raises(MissingConfigException) as err:
        compose_cfg(["batching=nope"])
    assert all(o in str(err.value) for o in ("pack_bfd", "pack_wrapped", "truncate", "pad"))


BATCHINGS = {
    "pad": Pad(),
    "truncate": Truncate(),
    "pack_bfd": Pack(method="bfd"),
    "pack_wrapped": Pack(method="wrapped"),
}


@pytest.mark.parametrize("source", ["builtin", "chat", "preference", "local", "mix"])
def test_a_source_and_a_batching_are_picked_independently(source):
    """``data`` says where the documents come from, ``batching`` how they are batched (it fills data.batching):
    every pair composes, the source keeps its own values and the batching its own options."""
    alone = compose_cfg([f"data={source}"]).data
    for name, expected in BATCHINGS.items():
        data = compose_cfg([f"data={source}", f"batching={name}", "data.dataset=x"]).data
        assert instantiate(data.batching) == expected
        assert {k: v for k, v in data.items() if k not in ("batching", "dataset")} == {
            k: v for k, v in alone.items() if k not in ("batching", "dataset")
        }
    assert instantiate(compose_cfg().data.batching) == Pack(method="bfd")  # the main job packs by default


def test_the_validation_batching_is_the_same_group_at_another_package():
    cfg = compose_cfg(["batching=pack_wrapped", "+batching@data.eval_batching=pad"])
    dm = instantiate(cfg.data)
    assert dm.settings.batching.batching == Pack(method="wrapped")
    assert dm.settings.batching.eval_batching == Pad()
    assert compose_cfg(["data.batching.group_by_length=true", "batching=pad"]).data.batching.group_by_length


def test_user_class_from_the_command_line():
    cfg = compose_cfg(["model._target_=my_pkg.MyLM", "+model.extra=1"])
    assert cfg.model._target_ == "my_pkg.MyLM" and cfg.model.extra == 1


def test_conf_ships_as_package():
    from lightning_seqmem.apps import train

    assert os.path.exists(os.path.join(CONF_DIR, "__init__.py"))
    assert train.CONFIG_PATH == "pkg://lightning_seqmem.conf"
    assert 'version_base="1.3"' in inspect.getsource(train)


def test_mix_weights_are_overridden_from_the_command_line():
    from lightning_seqmem import Mix
    from lightning_seqmem.apps.train import datamodule_config

    cfg = compose_cfg(["data=mix", "data.weights.chat=0.5", "+data.sources.more=builtin", "+data.weights.more=0.5"])
    data = datamodule_config(cfg.data)
    assert not set(MIX_KEYS) & set(data)
    mix = instantiate(data["dataset"])
    assert isinstance(mix, Mix) and mix.names == ("prose", "chat", "more")
    assert mix.weights == pytest.approx((0.7 / 1.7, 0.5 / 1.7, 0.5 / 1.7))


@pytest.mark.parametrize("option", ["builtin", "chat", "mix", "preference"])
def test_the_way_out_of_a_resume_mismatch_is_a_key_of_every_data_option(option):
    """``data.on_resume_mismatch=restart_epoch`` (the spelling the app's message gives) is taken as typed, no ``+``."""
    from lightning_seqmem.apps.overrides import check_overrides
    from lightning_seqmem.apps.train import datamodule_config

    overrides = [f"data={option}", "data.on_resume_mismatch=restart_epoch"]
    assert not check_overrides(overrides, "config")
    dm = instantiate(datamodule_config(compose_cfg(overrides).data))
    assert dm.settings.data.on_resume_mismatch == "restart_epoch"
