"""Hooks on an MoE model's routers: capture the routing (the server), replay it (the trainer; R3).

A Hugging Face MoE block (``Qwen3MoeSparseMoeBlock`` and its kin in transformers 5) asks
its router (``block.gate``) for ``(router_logits, scores, indices)``: the logits over all
experts ``[N, E]``, the weights of the chosen experts ``[N, k]`` and their ids ``[N, k]``.
The classes here hook that router and touch nothing else of the model:

- `RoutingCapture` records the ids each router chose, per layer (the embedded server's
  ``return_routed_experts``).
- `RoutingReplay` makes each router return the experts it is given instead of its own
  top-k. The weights are recomputed from the router's own logits at the replayed experts,
  ``softmax(logits)[replayed]`` (renormalised over the k when the router renormalises),
  so the gate's weight still gets gradient through the replayed experts' scores. This is
  the variant slime (``--use-rollout-routing-replay``) and verl (router replay "R3") use:
  only the choice of experts is fixed, never the weights. A row whose ids are -1 (no
  server routing: the last token of a sequence, a prompt the server did not report) keeps
  the router's own choice.
- `RouterLoadBalance` computes the routers' load-balancing (auxiliary) loss of a forward.

Layout: ``experts[t, layer, j]`` is the j-th expert the router of the ``layer``-th MoE block
picked for token ``t`` of the forward's flattened ``[N]`` tokens (docs/moe.md); how a
trajectory carries it is `arealite.moe.trajectory`.
"""

from __future__ import annotations

import torch

__all__ = ["RouterLoadBalance", "RoutingCapture", "RoutingReplay", "moe_routers"]


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The routers of ``model``'s MoE blocks, in layer order (a block is a module with
    ``experts`` and a ``gate`` that has ``top_k``); empty for a dense model."""
    routers = []
    for module in model.modules():
        gate = getattr(module, "gate", None)
        if hasattr(module, "experts") and isinstance(gate, torch.nn.Module) and hasattr(gate, "top_k"):
            routers.append(gate)
    return routers


def _router_output(output: object, where: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not (isinstance(output, tuple) and len(output) == 3):
        raise TypeError(
            f"{where}: the MoE router returned {type(output).__name__}; routing capture/replay needs a router "
            "returning (router_logits, scores, indices) as transformers 5's Qwen3-MoE/Mixtral routers do"
        )
    return output


class _RouterHooks:
    """A forward hook on each of ``routers`` (one per MoE layer, in order) while the context is
    entered; a subclass says what the hook of layer ``i`` does (`_hook`)."""

    def __init__(self, routers: list[torch.nn.Module]):
        self.routers = routers
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def _hook(self, layer: int):
        raise NotImplementedError

    def __enter__(self):
        for i, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class RoutingCapture(_RouterHooks):
    """Records the experts every router picks in each forward (``with RoutingCapture(model) as c``).

    After a forward, `take` returns ``[N, n_layers, k]`` int32 for that forward's N tokens.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__(moe_routers(model))
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no MoE router: routed experts exist only for "
                             "mixture-of-experts models")
        self._last: list[torch.Tensor | None] = [None] * len(self.routers)

    @property
    def n_layers(self) -> int:
        return len(self.routers)

    @property
    def top_k(self) -> int:
        return int(self.routers[0].top_k)

    def _hook(self, layer: int):
        def hook(module: torch.nn.Module, args: tuple, output: object) -> None:
            self._last[layer] = _router_output(output, "RoutingCapture")[2].detach()
        return hook

    def take(self) -> torch.Tensor:
        """``[N, n_layers, k]`` int32 of the last forward (on the model's device); clears the record."""
        if any(t is None for t in self._last):
            raise RuntimeError("RoutingCapture.take: no forward ran through every router since the last take")
        out = torch.stack([t.to(torch.int32) for t in self._last], dim=1)
        self._last = [None] * len(self.routers)
        return out


class RoutingReplay(_RouterHooks):
    """Makes the routers use given experts (``with RoutingReplay(model, experts)``; see the module doc).

    ``experts``: ``[N, n_layers, k]`` integer ids for the N tokens of the next forward(s); a row of -1
    keeps the router's own choice for that token and layer. ``routers``: the model's, when the
    caller has already found them (`moe_routers`).
    """

    def __init__(self, model: torch.nn.Module, experts: torch.Tensor,
                 routers: list[torch.nn.Module] | None = None):
        super().__init__(moe_routers(model) if routers is None else routers)
        if not self.routers:
            raise ValueError(f"routing replay: {type(model).__name__} has no MoE router; "
                             "set algorithm.routing_replay=none for a dense model")
        k = int(self.routers[0].top_k)
        if experts.dim() != 3 or experts.shape[1:] != (len(self.routers), k):
            raise ValueError(
                f"routing replay: routed_experts has shape {tuple(experts.shape)}, expected [N, {len(self.routers)}, "
                f"{k}] (tokens, MoE layers, top-k of this model); was the trajectory made by another model?"
            )
        n_experts = int(getattr(self.routers[0], "num_experts", 0) or 0)
        if n_experts and experts.numel() and int(experts.max()) >= n_experts:
            raise ValueError(f"routing replay: routed_experts holds expert id {int(experts.max())}, but the model "
                             f"has {n_experts} experts per layer")
        self.experts = experts.long()

    def _hook(self, layer: int):
        def hook(module: torch.nn.Module, args: tuple, output: object) -> tuple:
            logits, _, own = _router_output(output, "RoutingReplay")
            replay = self.experts[:, layer].to(own.device)
            if replay.shape[0] != logits.shape[0]:
                raise ValueError(f"routing replay: the forward routes {logits.shape[0]} tokens but routed_experts "
                                 f"holds {replay.shape[0]}; the micro-batch and its routing disagree")
            keep_own = (replay < 0).any(dim=-1, keepdim=True)
            chosen = torch.where(keep_own, own, replay)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            scores = probs.gather(-1, chosen)
            if getattr(module, "norm_topk_prob", True):
                scores = scores / scores.sum(dim=-1, keepdim=True)
            return logits, scores.to(logits.dtype), chosen
        return hook


class RouterLoadBalance(_RouterHooks):
    """The routers' load-balancing loss of the forwards inside (``with RouterLoadBalance(model) as lb``).

    Switch Transformer's loss per MoE layer, ``E * sum_i f_i * P_i`` over the E experts, with
    ``f_i`` the share of the layer's (token, chosen expert) pairs that went to expert i (by the
    router's own top-k, under R3 too: the engine enters this before the replay) and ``P_i`` the mean router
    probability of i; 1 when balanced. `loss` is its mean over the MoE layers, with gradient
    through the probabilities (the router's weight).
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__(moe_routers(model))
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no MoE router: the load-balancing loss is for "
                             "mixture-of-experts models; set actor.router_aux_loss_coef=0")
        self._terms: list[torch.Tensor] = []

    def _hook(self, layer: int):
        def hook(module: torch.nn.Module, args: tuple, output: object) -> None:
            logits, _, chosen = _router_output(output, "RouterLoadBalance")
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            n_experts = probs.shape[-1]
            counts = torch.bincount(chosen.reshape(-1), minlength=n_experts).to(probs.dtype)
            share = counts / max(chosen.numel(), 1)
            self._terms.append(n_experts * (share * probs.mean(dim=0)).sum())
        return hook

    def loss(self) -> torch.Tensor:
        """The mean over MoE layers of the forwards run since entering (or since the last call)."""
        if not self._terms:
            raise RuntimeError("RouterLoadBalance.loss: no forward ran through the routers")
        out = torch.stack(self._terms).mean()
        self._terms = []
        return out
