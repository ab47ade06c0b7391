"""The root of the config, `ArealiteConfig`: one field per section, each section's class from
the module named for it, and every section class importable from here.

    from arealite.config.schema import ArealiteConfig, ActorConfig

Sections are pydantic models (``extra="forbid"``; `arealite.config.section`) in which every field
carries a docstring (its description in the JSON schema and in docs/config_reference.md) and a
recommended default:

    experiment, saver, recover        arealite.config.experiment
    launch (ray, slurm)               arealite.config.launch
    server (sglang, sim)              arealite.config.server
    rollout, generation               arealite.config.rollout
    actor, critic, their engine       arealite.config.train_engine
    algorithm (mismatch, overlong)    arealite.config.algorithm
    data                              arealite.config.data
    evaluation, stats                 arealite.config.monitoring
    weight_sync                       arealite.config.weight_sync
    agent                             arealite.config.agent
"""

from __future__ import annotations

from pydantic import Field

from arealite.config.agent import AgentConfig
from arealite.config.algorithm import AlgorithmConfig, MismatchConfig, OverlongConfig
from arealite.config.data import REASONING_GYM_REWARD, DataConfig
from arealite.config.environments import ReasoningGymConfig
from arealite.config.experiment import ExperimentConfig, RecoverConfig, SaverConfig
from arealite.config.launch import LaunchConfig, RayLaunchConfig, SlurmLaunchConfig
from arealite.config.monitoring import EvaluationConfig, StatsConfig, WandbConfig
from arealite.config.rollout import GenerationConfig, RolloutConfig
from arealite.config.section import Section
from arealite.config.server import ServerConfig, SGLangOptions, SimOptions
from arealite.config.train_engine import (
    ActorConfig,
    CriticConfig,
    LoraConfig,
    OptimizerConfig,
    SimTrainOptions,
    TrainEngineConfig,
)
from arealite.config.weight_sync import WeightSyncConfig

# The root, then every section class by the module that holds it.
__all__ = [
    "ArealiteConfig", "Section",
    "ExperimentConfig", "SaverConfig", "RecoverConfig",
    "LaunchConfig", "RayLaunchConfig", "SlurmLaunchConfig",
    "ServerConfig", "SGLangOptions", "SimOptions",
    "RolloutConfig", "GenerationConfig",
    "TrainEngineConfig", "ActorConfig", "CriticConfig", "OptimizerConfig", "LoraConfig", "SimTrainOptions",
    "AlgorithmConfig", "MismatchConfig", "OverlongConfig",
    "DataConfig", "REASONING_GYM_REWARD", "ReasoningGymConfig",
    "EvaluationConfig", "StatsConfig", "WandbConfig",
    "WeightSyncConfig",
    "AgentConfig",
]


class ArealiteConfig(Section):
    """The whole configuration of one arealite run."""

    experiment: ExperimentConfig = Field(default_factory=ExperimentConfig)
    """Name, output directory and seed."""
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    """Processes the launchers start (local, Ray, Slurm)."""
    server: ServerConfig = Field(default_factory=ServerConfig)
    """Inference servers."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Rollout controller: concurrency, queues, staleness, retries, faults."""
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    """Sampling of training rollouts (evaluation overrides it to greedy)."""
    actor: ActorConfig = Field(default_factory=ActorConfig)
    """The trained policy and its train engine."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Rewards, advantages, PPO/GRPO loss."""
    critic: CriticConfig = Field(default_factory=CriticConfig)
    """The value model of PPO with a critic (`algorithm.adv_estimator: gae`)."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Datasets and the dataloader."""
    saver: SaverConfig = Field(default_factory=SaverConfig)
    """Periodic checkpoints."""
    recover: RecoverConfig = Field(default_factory=RecoverConfig)
    """Resuming a killed run."""
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    """Periodic greedy evaluation on held-out prompts."""
    stats: StatsConfig = Field(default_factory=StatsConfig)
    """Stats logging and plots."""
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    """How new weights reach the inference servers."""
    agent: AgentConfig = Field(default_factory=AgentConfig)
    """Agentic RL: the OpenAI-compatible endpoint agents call, the code sandbox, the LLM judge."""
