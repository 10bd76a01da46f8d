"""The roles of an online run beside the actor: where each one's folder, tokenizer and layout are checked and its
model loaded (`OnlineRoles`, a mixin of `megalign.trainers.online.OnlineTrainer`).

- Every role's folder is checked before any weights load (`check_role_folders`): the reference and the reward
  models that read the actor's token ids must have been saved with its tokenizer; a judge reads its own. With
  `actor.lora` the reference is the actor with adapters off, so its own path, layout and offload settings are
  refused (`megalign.trainers.online_lora.check_adapter_off_reference`).
- Each role has its own tp x pp (`role_layout`), checked to see the actor's batches (`check_same_batch`).
- Reward models (`reward_model`): outcome or process, optionally with their own tokenizer (`megalign.roles.reward`).
- Judges (`judge_roles`): one `megalign.roles.judge.Judge` per entry of `reward.judges`, loaded with `load_judge`
  on its own tp layout and dtype with its own tokenizer (its folder's, which must hold tokenizer files: a judge
  never silently falls back to another tokenizer). Judges are frozen roles with an offloadable "weights" part:
  the `Reward` role lists them among its models, so the trainer places and offloads them like reward models. Their
  templates were checked against the fields each term supplies when the config loaded (`RewardConfig`), before
  any of this.
"""
from __future__ import annotations

from typing import Optional

from megalign.data import check_vocab
from megalign.models import ModelConfig, from_pretrained, stage_from_pretrained
from megalign.parallel import ParallelLayout
from megalign.roles import DTYPES, ModelRoleConfig, TrainedRoleConfig
from megalign.roles.judge import Judge, load_judge
from megalign.roles.reward import OutcomeReward, ProcessReward, RewardModelConfig
from megalign.roles.reward_exports import load_prm_info
from megalign.trainers.base import check_model_path, check_same_batch, check_stages
from megalign.trainers.model_checks import ModelError, check_tokenizer, folder_tokenizer
from megalign.trainers.online_config import check_microbatches
from megalign.trainers.online_lora import check_adapter_off_reference


class OnlineRoles:
    """Role building and start-up checks of an `OnlineTrainer` (module doc); reads `cfg`, `layout` (the actor's),
    `tokenizer`, `name`, `token_level_rewards`, `needs_reference`, `layout_for` and `check_model` of the trainer."""

    def check_role_folders(self) -> None:
        """Before any weights load: every role's folder exists, process reward models only for algorithms with
        per-token rewards, and the roles that read the actor's ids were saved with its tokenizer."""
        cfg = self.cfg
        if self.needs_reference() and cfg.actor.lora is not None:
            check_adapter_off_reference(cfg.reference, cfg.actor)
        if self.needs_reference() and cfg.reference.path is not None:
            check_model_path(cfg.reference.path, "reference.path")
            check_tokenizer(self.tokenizer, "reference.path", cfg.reference.path)
        for key, model_cfg in cfg.reward.reward_models():
            check_model_path(model_cfg.path, f"{key}.path")
            if model_cfg.kind == "process" and not self.token_level_rewards:
                raise ValueError(f"{key} ({model_cfg.name!r}) is a process reward model, whose step rewards need an "
                                 f"algorithm that trains on per-token rewards (PPO); {self.name} uses one score per response")
            if model_cfg.tokenizer == "actor":
                check_tokenizer(self.tokenizer, f"{key}.path", model_cfg.path,
                                f", or {key}.tokenizer=own (an outcome model: the text is re-tokenised for it)"
                                if model_cfg.kind == "outcome" else "")
        for i, judged in enumerate(cfg.reward.judges):
            self.check_judge_folder(f"reward.judges[{i}].judge", judged.judge.path)

    @staticmethod
    def check_judge_folder(key: str, path: str) -> None:
        """A judge's folder (config `key`) is an HF checkpoint with its own tokenizer files (module doc)."""
        check_model_path(path, f"{key}.path")
        if folder_tokenizer(path, f"{key}.path") is None:
            raise ModelError(f"{key}.path={path!r} holds no tokenizer files (tokenizer.json, tokenizer_config.json or "
                             f"tokenizer.model): a judge reads its own tokenizer and chat template from its folder")

    def role_layout(self, key: str, cfg: ModelRoleConfig) -> ParallelLayout:
        """The layout of role `key` (its `tp` x `pp`), checked to see the actor's batches (`check_same_batch`: a
        role at pp = 1 beside a pp > 1 actor scores the batch on every rank of the actor's pp group)."""
        check_microbatches(key, cfg)
        ep = cfg.ep if isinstance(cfg, TrainedRoleConfig) else 1  # the PPO critic's
        layout = self.layout_for(cfg.tp, cfg.pp, key, cfg.stage_split(key), ep, cfg.path)
        check_same_batch(layout, key, self.layout, "actor")
        return layout

    def load_role_model(self, key: str, cfg: ModelRoleConfig, layout: ParallelLayout, path: Optional[str] = None,
                        **kwargs):
        """Role `key`'s model from `path` (default `cfg.path`) on `layout`: this rank's pipeline stage when pp > 1
        (layers split as the role's stage options say, checked naming the key), else the whole (tp-sharded) model."""
        path = path or cfg.path
        if layout.pp == 1:
            return from_pretrained(path, layout=layout, **kwargs)
        check_stages(ModelConfig.from_hf(path).num_hidden_layers, layout.pp, key, f"{key} {path!r}", layout.stages)
        return stage_from_pretrained(path, layout, **kwargs)

    def reward_model(self, key: str, cfg: RewardModelConfig, longest: int, what: str):
        """The reward-model role of config `key` on its own layout (its pipeline stage at pp > 1) and dtype, checked
        against the run; with `tokenizer: own`, an outcome model with its folder's tokenizer, which then reads the
        text re-tokenised (`megalign.roles.reward`)."""
        layout = self.role_layout(key, cfg)
        if cfg.tokenizer == "own":
            own = folder_tokenizer(cfg.path, f"{key}.path")
            if own is None:
                raise ModelError(f"{key}.tokenizer=own but {key}.path={cfg.path!r} holds no tokenizer files "
                                 f"(tokenizer.json, tokenizer_config.json or tokenizer.model)")
            model = self.load_role_model(key, cfg, layout, kind="reward", dtype=DTYPES[cfg.dtype])
            try:
                check_vocab(own, model.config.vocab_size, f"{key}.path {cfg.path!r}")
            except ValueError as exc:
                raise ModelError(str(exc)) from exc
            return OutcomeReward(cfg, model, layout, own)
        if cfg.kind == "outcome":
            model = self.load_role_model(key, cfg, layout, kind="reward", dtype=DTYPES[cfg.dtype])
            self.check_model(model, f"{key}.path", cfg.path, longest, what)
            return OutcomeReward(cfg, model, layout)
        info = load_prm_info(cfg.path)
        tokens = {}
        for side in ("negative", "positive"):
            encoded = self.tokenizer.encode(info[f"{side}_token"])
            if encoded != [info[f"{side}_token_id"]]:
                raise ValueError(f"{key}.path={cfg.path!r}: its prm.json {side}_token {info[f'{side}_token']!r} is id "
                                 f"{info[f'{side}_token_id']} but the run's tokenizer encodes it as {encoded}: the PRM "
                                 f"was trained with another tokenizer")
            tokens[side] = encoded[0]
        separator = self.tokenizer.encode(info["separator"])
        if not separator:
            raise ValueError(f"{key}.path={cfg.path!r}: its step separator {info['separator']!r} encodes to no token")
        model = self.load_role_model(key, cfg, layout, dtype=DTYPES[cfg.dtype])
        # a finished response's last step is read with the separator in place of its EOS (`prm_inputs`)
        self.check_model(model, f"{key}.path", cfg.path, longest + len(separator) - 1, what + " and the step separator")
        return ProcessReward(cfg, model, layout, (tokens["negative"], tokens["positive"]), separator,
                             self.tokenizer.eos_id)

    def judge_roles(self) -> list[Judge]:
        """One judge role per entry of `reward.judges`, in order, each on its own tp layout (module doc)."""
        judges = []
        for i, judged in enumerate(self.cfg.reward.judges):
            key = f"reward.judges[{i}].judge"
            judges.append(load_judge(judged.name, judged.judge, self.role_layout(key, judged.judge), key))
        return judges
