"""PPO's critic: a value model (the policy's backbone plus a scalar head) on its own FSDP engine.

`ValueEngine` is an `FSDPEngine` whose model outputs one value per token; `Critic` scores a
batch (``batch["values"]``, from which `PPOActor` computes GAE advantages and returns) and
trains on the returns with the clipped value loss (`arealite.algo.value`). It has its own
optimizer and LR schedule (``critic.optimizer``) and its own sharded checkpoint, written
beside the actor's.
"""

from arealite.critic.critic import Critic, WithCritic
from arealite.critic.engine import ValueEngine, value_model

__all__ = ["Critic", "WithCritic", "ValueEngine", "value_model"]
