"""Pure loss and advantage functions of the alignment algorithms; no models, no process groups unless passed in.

`megalign.algos.registry` (imported by its users, not here) is the table of algorithms: name -> config, trainer, roles.
`megalign.algos.policy_loss_options` (also imported by its users) is the `algo.policy_loss` choice of the GRPO and PPO configs.
"""
from megalign.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    discounted_returns,
    estimator,
    reinforce_plus_plus,
)
from megalign.algos.aggregation import LOSS_AGGREGATIONS, LossAggregation, aggregate_loss, loss_normalizer
from megalign.algos.calibration import platt_fit, platt_nll
from megalign.algos.common import MetricSum
from megalign.algos.grpo import informative_groups, overlong_mask, overlong_penalty, response_advantages
from megalign.algos.kto import (
    KTO_WEIGHT_RATIO_RANGE,
    KTOStats,
    check_kto_weight_ratio,
    kto_loss,
    kto_loss_at,
    kto_reference_point,
    kto_weight_ratio,
)
from megalign.algos.preference import (
    DPO_LOSSES,
    DPO_VARIANTS,
    ORPO_MAX_AVG_LOGP,
    PAIR_LOSSES,
    DPOLoss,
    PairLogps,
    PairLoss,
    PreferenceAlgoConfig,
    PreferenceStats,
    cpo_loss,
    dpo_loss,
    dpo_variant_loss,
    orpo_loss,
    pair_losses,
    reward_model_loss,
    simpo_loss,
    wpo_token_logps,
    wpo_weights,
)
from megalign.algos.policy_losses import POLICY_LOSSES, cispo_loss, gspo_loss, ppo_loss, select_policy_loss
from megalign.algos.prm import IGNORE_INDEX, PRMStats, math_shepherd_labels, prm_loss, prm_token_loss

__all__ = [
    "LOSS_AGGREGATIONS", "LossAggregation", "aggregate_loss", "informative_groups", "loss_normalizer",
    "overlong_mask", "overlong_penalty", "response_advantages",
    "MetricSum", "platt_fit", "platt_nll",
    "ADVANTAGE_ESTIMATORS", "AdvantageEstimator", "discounted_returns", "estimator", "reinforce_plus_plus",
    "POLICY_LOSSES", "cispo_loss", "gspo_loss", "ppo_loss", "select_policy_loss",
    "DPO_LOSSES", "DPO_VARIANTS", "DPOLoss", "ORPO_MAX_AVG_LOGP", "PAIR_LOSSES", "PairLogps", "PairLoss",
    "PreferenceAlgoConfig", "PreferenceStats", "cpo_loss", "dpo_loss", "dpo_variant_loss",
    "orpo_loss", "pair_losses", "reward_model_loss", "simpo_loss", "wpo_token_logps", "wpo_weights",
    "KTO_WEIGHT_RATIO_RANGE", "KTOStats", "check_kto_weight_ratio", "kto_loss", "kto_loss_at", "kto_reference_point",
    "kto_weight_ratio",
    "IGNORE_INDEX", "PRMStats", "math_shepherd_labels", "prm_loss", "prm_token_loss",
]
