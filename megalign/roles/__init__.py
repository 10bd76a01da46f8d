"""The roles of colocated RLHF (actor, reference, reward; the critic joins with PPO) and their offload."""
from megalign.roles.actor import Actor, PolicyRole, Reference, TrainableRole, response_logprobs
from megalign.roles.base import DTYPES, ModelRole, ModelRoleConfig, Role
from megalign.roles.reward import Reward, RewardConfig

__all__ = [
    "Actor", "PolicyRole", "Reference", "TrainableRole", "response_logprobs",
    "DTYPES", "ModelRole", "ModelRoleConfig", "Role", "Reward", "RewardConfig",
]
