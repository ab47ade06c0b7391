"""Mixture-of-experts routing, shared by the rooms it crosses (docs/moe.md).

The experts an MoE model routed each token to travel from the server to the trainer, which
replays them (R3). Each room uses these basics through its own small adapter:

- `router_hooks`: hooks on a model's MoE routers: capture the chosen experts (the embedded
  server), replay given ones (the train engine), the load-balancing loss.
- `wire`: ``meta_info.routed_experts`` as SGLang sends it, encoded (the embedded server) and
  decoded (the inference client's wire format) side by side.
- `trajectory`: the ``routed_experts`` trajectory key: its layout, its builders from the
  completions (the workflows) and its reading from a packed micro-batch (the train engine).

This package imports only torch and the ground floor (api, utils, config), never a room.
"""
