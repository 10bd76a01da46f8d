"""The registry of algorithms: a name -> its config class, its trainer and the roles it needs.

The entry points (`launch/train_<name>.py`, the generic `launch/train.py`), the memory planner
(`megalign.plan --run-config`), the command line's `--help` and the tests read which algorithms
exist and what each needs from this one table (the shape of torchtitan's train specs), so none of
them keeps its own list or guesses one from a YAML's sections.

Design choices:

- An entry names its config class and train function as "module:attribute", imported on first use:
  `algos` sits below `trainers` in the dependency order, so the table names the trainers but never
  imports them at import time (`import megalign.algos` stays as light as its losses).
- Roles: every algorithm trains one model (`actor` / `model`); whether it has a critic and a reward
  role (rollouts scored by verifiers and reward models) is fixed per algorithm; whether the frozen
  reference exists depends on the config (GRPO's and REINFORCE++'s kl_coef, PPO's KL, DPO's
  reference-free losses), so an entry names the config attribute that says so, the same one its
  trainer reads: planner and trainer cannot disagree.
- A YAML names its algorithm with the top-level key `algorithm`, which every config class declares
  typed as its own name (`algorithm_option`): the launcher of another algorithm refuses the file
  naming the key and line, and the resolved `config.yaml` of a run names it too. A file without the
  key (older configs) is the algorithm whose config class alone loads it; none or several is an
  error asking for the key.
"""
from __future__ import annotations

import dataclasses
import importlib
import operator
import os
from typing import Any, Callable, Literal, Optional, Sequence, Union

import yaml

from megalign.config import ConfigError, load_config, option


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One registered algorithm (module doc)."""

    name: str
    summary: str
    family: Literal["online", "supervised"]
    config: str
    """"module:ConfigClass" of its typed config."""
    train: str
    """"module:function" that runs it: `train(cfg) -> TrainResult`, on every rank after the process group exists."""
    reference: Union[bool, str]
    """Whether the frozen reference is built: always, never, or the dotted config attribute that says so."""
    critic: bool = False
    reward: bool = False
    """Whether rollouts are scored by a reward role (verifier terms and reward models)."""

    def config_class(self) -> type:
        return _import(self.config)

    def train_fn(self) -> Callable[[Any], Any]:
        return _import(self.train)

    def needs_reference(self, cfg: Any) -> bool:
        """Whether a run of `cfg` (this algorithm's config) builds the frozen reference."""
        if isinstance(self.reference, bool):
            return self.reference
        return bool(operator.attrgetter(self.reference)(cfg))


def _import(ref: str) -> Any:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (
    Algorithm("sft", "supervised fine-tuning on prompt/response pairs or chat messages", "supervised",
              "megalign.trainers.sft:SFTConfig", "megalign.trainers.sft:train_sft", reference=False),
    Algorithm("dpo", "pairwise preference losses: the DPO family and its variants, SimPO, CPO, ORPO (algo.loss)", "supervised",
              "megalign.trainers.preference:DPOConfig", "megalign.trainers.preference:train_dpo",
              reference="algo.uses_reference"),
    Algorithm("kto", "KTO on unpaired desirable / undesirable rows", "supervised",
              "megalign.trainers.kto:KTOConfig", "megalign.trainers.kto:train_kto", reference=True),
    Algorithm("rm", "Bradley-Terry reward model on preference pairs", "supervised",
              "megalign.trainers.preference:RMConfig", "megalign.trainers.preference:train_rm", reference=False),
    Algorithm("prm", "process (or outcome) reward model on stepwise rows", "supervised",
              "megalign.trainers.prm:PRMConfig", "megalign.trainers.prm:train_prm", reference=False),
    Algorithm("grpo", "GRPO and its critic-free variants: DAPO, Dr. GRPO, RLOO, REINFORCE++ (algo.advantage)", "online",
              "megalign.trainers.grpo:GRPOConfig", "megalign.trainers.grpo:train_grpo",
              reference="algo.uses_reference", reward=True),
    Algorithm("ppo", "PPO with a critic and GAE", "online",
              "megalign.trainers.ppo:PPOConfig", "megalign.trainers.ppo:train_ppo",
              reference="algo.uses_kl", critic=True, reward=True),
    Algorithm("online_dpo", "online DPO on pairs of the actor's own samples ranked by the reward role", "online",
              "megalign.trainers.online_dpo:OnlineDPOConfig", "megalign.trainers.online_dpo:train_online_dpo",
              reference="algo.uses_reference", reward=True),
)}


def algorithm_option(name: str) -> Any:
    """The `algorithm` field of `name`'s config class (annotate it `Literal[name]`)."""
    return option(name, doc="the algorithm this config is for (megalign.algos.registry); launch/train.py and "
                            "the planner run a YAML by it")


def get(name: str) -> Algorithm:
    """The algorithm registered as `name`; a ConfigError naming the registered ones otherwise."""
    if name not in ALGORITHMS:
        raise ConfigError(f"algorithm {name!r} is not registered; registered: {', '.join(ALGORITHMS)}", key="algorithm")
    return ALGORITHMS[name]


def _named(path: Optional[str], overrides: Sequence[str]) -> Optional[str]:
    """The algorithm named by the last `algorithm=` override, else by the YAML's top-level key, else None."""
    for override in reversed(overrides):
        key, _, value = override.partition("=")
        if key.strip() == "algorithm":
            return get(value.strip()).name
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            node = yaml.compose(f)
    except (OSError, yaml.YAMLError):
        return None  # load_config reports an unreadable file with its own message
    for key, value in node.value if isinstance(node, yaml.MappingNode) else ():
        if key.value == "algorithm":
            if value.value not in ALGORITHMS:
                raise ConfigError(f"config file {path!r} line {key.start_mark.line + 1}: algorithm {value.value!r} "
                                  f"is not registered; registered: {', '.join(ALGORITHMS)}", key="algorithm")
            return value.value
    return None


def load(path: Optional[str], overrides: Sequence[str] = ()) -> tuple[Algorithm, Any]:
    """(algorithm, its loaded config) of a YAML file and `key=value` overrides (module doc: which algorithm)."""
    name = _named(path, overrides)
    if name is not None:
        return ALGORITHMS[name], load_config(ALGORITHMS[name].config_class(), path, overrides)
    loaded, errors = [], set()
    for algo in ALGORITHMS.values():
        try:
            loaded.append((algo, load_config(algo.config_class(), path, overrides)))
        except ConfigError as exc:
            errors.add(str(exc))
    if len(loaded) == 1:
        return loaded[0]
    if not loaded and len(errors) == 1:  # the same error for every algorithm: the file itself (unreadable, not YAML)
        raise ConfigError(errors.pop())
    where = f"config file {os.fspath(path)!r} names" if path is not None else "the command line names"
    fits = f"it loads as each of {', '.join(a.name for a, _ in loaded)}" if loaded else "no algorithm's config loads it"
    raise ConfigError(f"{where} no algorithm and {fits}: add a top-level `algorithm: <name>` "
                      f"(one of {', '.join(ALGORITHMS)}) or the override algorithm=<name>", key="algorithm")
