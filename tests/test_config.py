"""Typed config loading: YAML + dotted overrides, strict keys and types, help, atomic round trip."""
from __future__ import annotations

import dataclasses
import os
from typing import Literal, Optional, Sequence, Union

import pytest

from megalign.config import ConfigError, config_help, load_config, option, save_config


@dataclasses.dataclass
class Optim:
    lr: float = option(1e-3, doc="peak learning rate")
    betas: tuple[float, float] = option((0.9, 0.999), doc="Adam betas")
    schedule: Literal["constant", "cosine"] = option("constant", doc="learning-rate schedule")

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


@dataclasses.dataclass
class Term:
    name: str = option(doc="reward name")
    weight: float = option(1.0, doc="weight in the sum")


@dataclasses.dataclass
class Train:
    optim: Optim = option(Optim(), doc="optimizer")
    steps: int = option(10, doc="number of steps")
    grad_clip: Optional[float] = option(None, doc="max grad norm, none to disable")
    offload: bool = option(False, doc="offload idle roles")
    eval_optim: Optional[Optim] = option(None, doc="a second optimizer, off by default")


@dataclasses.dataclass
class Extras:
    weights: dict[str, float] = option({}, doc="named weights")
    sizes: Sequence[int] = option((1, 2), doc="any sequence of ints")
    seed: Union[int, str] = option(0, doc="an int seed or a named one")


@dataclasses.dataclass
class Top:
    train: Train = option(Train(), doc="training")
    name: str = option("run", doc="run name")
    tags: list[str] = option([], doc="free-form tags")
    rewards: list[Term] = option([Term("math_accuracy")], doc="reward terms")
    resume: Optional[str] = option(None, doc="checkpoint to resume from")
    extras: Extras = option(Extras(), doc="less common annotations")


def write(tmp_path, text: str) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


def test_defaults_yaml_and_overrides_apply_in_order(tmp_path):
    path = write(tmp_path, "train:\n  steps: 5\n  optim:\n    lr: 1e-4\nname: first\n")
    cfg = load_config(Top, path, ["train.optim.schedule=cosine", "name=007", "train.steps=7", "tags=[a, b]"])
    assert cfg.train.steps == 7
    assert cfg.train.optim.lr == 1e-4  # PyYAML reads 1e-4 as a string; the float field parses it
    assert cfg.train.optim.schedule == "cosine"
    assert cfg.train.optim.betas == (0.9, 0.999)
    assert cfg.name == "007"  # a str field takes override text verbatim, not YAML's int 7
    assert cfg.tags == ["a", "b"]
    assert cfg.rewards == [Term("math_accuracy", 1.0)]
    assert load_config(Top) == Top()


def test_unknown_keys_name_the_full_dotted_key_and_list_valid_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"'train\.optim\.lrr' \(did you mean 'train\.optim\.lr'\?\); valid keys under 'train\.optim': lr, betas, schedule"):
        load_config(Top, overrides=["train.optim.lrr=1"])
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.stepz'.*valid keys under 'train': optim, steps"):
        load_config(Top, write(tmp_path, "train:\n  stepz: 3\n"))
    with pytest.raises(ConfigError, match=r"unknown config key 'bogus'; valid keys at the top level: train, name"):
        load_config(Top, overrides=["bogus=1"])
    with pytest.raises(ConfigError, match=r"unknown config key 'rewards\[0\]\.wieght'"):
        load_config(Top, overrides=["rewards=[{name: format, wieght: 2}]"])
    with pytest.raises(ConfigError, match=r"'train\.steps' is a int, not a section"):
        load_config(Top, overrides=["train.steps.x=1"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.steps=2.5", r"'train\.steps' expects int, got 2\.5"),
        ("train.steps=true", r"'train\.steps' expects int, got True"),
        ("train.offload=1", r"'train\.offload' expects bool, got 1"),
        ("train.offload=yes please", r"'train\.offload' expects bool"),
        ("train.optim.lr=fast", r"'train\.optim\.lr' expects float, got 'fast'"),
        ("train.optim.schedule=linear", r"'train\.optim\.schedule' must be one of \['constant', 'cosine'\]"),
        ("train.optim.betas=[0.9]", r"'train\.optim\.betas' expects tuple\[float, float\]"),
        ("tags=[1, x]", r"'tags\[0\]' expects str, got 1"),
        ("train.grad_clip=big", r"'train\.grad_clip' expects Optional\[float\]"),
        ("train=3", r"'train' expects Train, got 3"),
        ("train.optim.lr=-1", r"invalid config 'train\.optim' \(Optim\): lr must be > 0"),
        ("rewards=[{weight: 2}]", r"missing required config key 'rewards\[0\]\.name' \(str\): reward name"),
        ("train.steps", r"must look like key\.sub=value"),
        ("tags=[a", r"cannot parse value"),
    ],
)
def test_bad_values_name_the_key_and_expected_type(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Top, overrides=[override])


def test_optional_literal_list_bool_and_optional_sections():
    cfg = load_config(
        Top,
        overrides=[
            "train.grad_clip=1",
            "train.offload=true",
            "resume=null",
            "rewards=[{name: format, weight: 0.5}, {name: mod:fn}]",
            "train.eval_optim.lr=0.5",
        ],
    )
    assert cfg.train.grad_clip == 1.0 and isinstance(cfg.train.grad_clip, float)
    assert cfg.train.offload is True
    assert cfg.resume is None
    assert cfg.rewards == [Term("format", 0.5), Term("mod:fn", 1.0)]
    assert cfg.train.eval_optim == Optim(lr=0.5)  # an override inside a None section builds it from defaults
    assert load_config(Top, overrides=["train.grad_clip=null"]).train.grad_clip is None


def test_dict_sequence_and_union_annotations():
    cfg = load_config(Top, overrides=["extras.weights={a: 1, b: 0.5}", "extras.sizes=[3]", "extras.seed=abc"])
    assert cfg.extras == Extras(weights={"a": 1.0, "b": 0.5}, sizes=(3,), seed="abc")
    assert load_config(Top, overrides=["extras.seed=4"]).extras.seed == 4
    with pytest.raises(ConfigError, match=r"'extras\.weights\.b' expects float, got 'x'"):
        load_config(Top, overrides=["extras.weights={a: 1, b: x}"])
    with pytest.raises(ConfigError, match=r"'extras\.seed' expects Union\[int, str\], got 1\.5"):
        load_config(Top, overrides=["extras.seed=1.5"])


def test_bad_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file .*missing.yaml"):
        load_config(Top, str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="must hold a mapping, got list"):
        load_config(Top, write(tmp_path, "- 1\n- 2\n"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(Top, write(tmp_path, "train: [\n"))
    with pytest.raises(ConfigError, match="not one string"):
        load_config(Top, overrides="name=x")


def test_save_round_trips_and_leaves_no_temporary(tmp_path):
    cfg = load_config(Top, overrides=["train.optim.betas=[0.8, 0.9]", "tags=[x]", "train.grad_clip=0.5", "train.eval_optim.schedule=cosine"])
    path = tmp_path / "run" / "config.yaml"
    save_config(cfg, path)
    assert os.listdir(tmp_path / "run") == ["config.yaml"]
    assert load_config(Top, path) == cfg
    assert "betas:\n    - 0.8\n    - 0.9" in path.read_text()


def test_help_lists_every_leaf_with_type_default_and_doc():
    text = config_help(Top)
    assert "train.optim.lr (float, default 0.001): peak learning rate" in text
    assert "train.optim.schedule (Literal['constant', 'cosine'], default 'constant'): learning-rate schedule" in text
    assert "train.eval_optim.lr (float, default 0.001)" in text
    assert "resume (Optional[str], default None): checkpoint to resume from" in text
    assert "name (str, required): reward name" not in text  # list items are not expanded as sections


def test_errors_name_the_file_line_or_override_the_value_came_from(tmp_path):
    path = write(tmp_path, "name: x\ntrain:\n  steps: 5\n  optim:\n    lrr: 1\n")
    with pytest.raises(ConfigError, match=rf"^config file '{path}' line 5: unknown config key 'train\.optim\.lrr'") as err:
        load_config(Top, path)
    assert err.value.key == "train.optim.lrr" and "\n" not in str(err.value)
    path = write(tmp_path, "train:\n  steps: five\n")
    with pytest.raises(ConfigError, match=rf"^config file '{path}' line 2: config key 'train\.steps' expects int"):
        load_config(Top, path)
    # an override replaces the file's value, so the error names the override, not the file
    with pytest.raises(ConfigError, match=r"^override 'train\.steps=2\.5': config key 'train\.steps' expects int"):
        load_config(Top, path, ["train.steps=2.5"])
    with pytest.raises(ConfigError, match=r"^override 'train\.optim\.lrr=1': unknown config key 'train\.optim\.lrr'"):
        load_config(Top, None, ["train.optim.lrr=1"])
    with pytest.raises(ConfigError, match=r"^override 'rewards=\[\{weight: 2\}\]': missing required config key 'rewards\[0\]\.name'"):
        load_config(Top, None, ["rewards=[{weight: 2}]"])
    # a failed check of a section names the file's section and every override inside it
    path = write(tmp_path, "train:\n  optim:\n    schedule: cosine\n")
    with pytest.raises(ConfigError, match=rf"^config file '{path}' line 2, override 'train\.optim\.lr=-1': invalid config 'train\.optim'"):
        load_config(Top, path, ["train.optim.lr=-1"])
    with pytest.raises(ConfigError, match=rf"^config file '{path}' line 2: invalid config 'train\.optim'"):
        load_config(Top, write(tmp_path, "train:\n  optim:\n    lr: -1\n"))
    path = write(tmp_path, "train: [\n")
    with pytest.raises(ConfigError, match=rf"^config file '{path}' is not valid YAML: .*line 2") as err:
        load_config(Top, path)
    assert "\n" not in str(err.value)


@dataclasses.dataclass
class WithTunedSection:
    optim: Optim = option(Optim(lr=0.5, schedule="cosine"), doc="tuned optimizer")
    spare: Optional[Optim] = option(None, doc="off by default")


def test_help_shows_the_defaults_of_a_sections_default_value():
    text = config_help(WithTunedSection)
    assert "optim.lr (float, default 0.5): peak learning rate" in text
    assert "optim.schedule (Literal['constant', 'cosine'], default 'cosine')" in text
    assert "spare: off by default (None by default; setting a key in it creates it from the defaults below)" in text
    assert "spare.lr (float, default 0.001)" in text
