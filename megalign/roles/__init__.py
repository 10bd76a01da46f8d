"""The roles of colocated RLHF (actor, critic, reference, reward models) and their offload."""
from megalign.roles.actor import Actor, PolicyRole, Reference, TrainableRole, head_logprobs, response_logprobs
from megalign.roles.critic import TOKEN_CLASSIFICATION, Critic, response_values
from megalign.roles.base import DTYPES, ModelRole, ModelRoleConfig, Role, TrainedRoleConfig
from megalign.roles.reward import Reward, RewardConfig, RewardModelConfig
from megalign.roles.reward_combine import EnsembleRewardConfig, GatedRewardConfig

__all__ = [
    "Actor", "Critic", "TOKEN_CLASSIFICATION", "response_values", "PolicyRole", "Reference", "TrainableRole", "head_logprobs", "response_logprobs",
    "DTYPES", "ModelRole", "ModelRoleConfig", "Role", "TrainedRoleConfig", "Reward", "RewardConfig",
    "RewardModelConfig", "GatedRewardConfig", "EnsembleRewardConfig",
]
