"""The environment adapters as built-in workflows: `rollout.workflow: verifiers` and `openenv`.

The adapters live in `arealite.environments` and import their libraries only when built,
so naming them here costs nothing where the libraries are not installed.
"""

from __future__ import annotations

from arealite.environments.openenv_env import OpenEnvWorkflow
from arealite.environments.verifiers_env import VerifiersWorkflow
from arealite.workflow.registry import builtin_workflow

builtin_workflow("verifiers")(VerifiersWorkflow)
builtin_workflow("openenv")(OpenEnvWorkflow)
