"""Adapters for tasks that live in environment libraries: reasoning-gym's scores as rewards,
verifiers environments and OpenEnv servers as workflows (docs/environments.md)."""
