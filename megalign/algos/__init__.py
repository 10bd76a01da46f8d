"""Pure loss and advantage functions of the alignment algorithms; no models, no process groups unless passed in."""
from megalign.algos.grpo import (
    LOSS_AGGREGATIONS,
    LossAggregation,
    aggregate_loss,
    informative_groups,
    loss_normalizer,
    overlong_mask,
    overlong_penalty,
    response_advantages,
)

__all__ = [
    "LOSS_AGGREGATIONS", "LossAggregation", "aggregate_loss", "informative_groups", "loss_normalizer",
    "overlong_mask", "overlong_penalty", "response_advantages",
]
