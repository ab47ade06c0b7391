"""Simulation: a GPU cluster's cost model in place of the models, everything around it real.

- `cost_model`: what a GPU server takes for a decode step, a prefill, a weight transfer
  (`SimSpec`, the GPU and model presets).
- `runner`: `SimRunner`, a `GenerationRunner` that schedules as SGLang does and sleeps the
  cost model's time instead of computing (no model, no thread).
- `serve`: many simulated servers in one process, each the embedded server's own HTTP app
  with a `SimRunner` (``python -m arealite.sim``; ``launch.server_backend: sim``).
- `train_engine`: `SimTrainEngine`, the train-engine contract over a training cluster's cost
  (``actor.backend: sim``).

The simulator builds on the server's app and contracts; the server never imports it.
See docs/scale.md.
"""
