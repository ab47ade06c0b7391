"""Expert parallelism for mixture-of-experts models (``actor.ep_size``).

The trainer's ranks form an ``edp x ep`` mesh: the ``ep`` ranks of one expert group (ranks
``[g * ep, (g + 1) * ep)``) each hold ``E / ep`` of every MoE layer's experts, rank ``i`` the
experts ``[i * E / ep, (i + 1) * E / ep)``; the ``edp`` groups hold the same experts. Data
stays data-parallel: each rank computes its own micro-batches. In each MoE block the router
runs on the rank's own tokens; every (token, chosen expert) pair is sent to the rank holding
that expert by an all-to-all, the expert's MLP runs there, and a second all-to-all brings the
results back, where they are weighted by the router's scores and summed per token. Both
all-to-alls are autograd functions whose backward is the reverse all-to-all, over any backend
(gloo on CPU).

The expert weights (transformers 5 keeps them fused: ``experts.gate_up_proj [E, 2I, H]``,
``experts.down_proj [E, H, I]``) become DTensors ``Shard(0)`` on the ``ep`` mesh, left out
of FSDP2 (its ``ignored_params``); FSDP2 shards everything else over all ranks as without
experts parallelism. So a full state dict, a DCP checkpoint, a weight push and the gradient
norm (`parallel.grad_norm.clip_grad_norm`, per mesh) see the experts of every rank without
further code. The gradient of an expert weight holds what every rank's tokens contributed
through the all-to-all; `finish_expert_gradients` sums it over the ``edp`` replicas
and divides by the loss's scale, which is what FSDP2's average over ranks does to the others.
With tensor parallelism the ``ep`` ranks of a group share a tensor-parallel position, and each
runs the block on its share of the tokens (`moe_tokens`).

Every rank of an expert group must run the same number of MoE forwards (and backwards) in the
same order: the engine's micro-batch planner gives each rank the same number of micro-batches
(dummies included), and a block whose rank received no token still takes part in the gradient's
all-to-alls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from arealite.config.problems import ConfigProblem

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ExpertShard", "apply_expert_parallel", "expert_parallel_problems", "finish_expert_gradients",
           "moe_experts"]

#: The fused expert weights of a transformers 5 MoE block's ``experts`` module (first dim: experts).
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def moe_experts(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
    """``(block, attribute name, experts module)`` of each MoE block of ``model``, in layer order
    (a block has ``experts`` with the fused weights and a ``gate`` with ``top_k``)."""
    found = []
    for block in model.modules():
        experts = getattr(block, "experts", None)
        gate = getattr(block, "gate", None)
        if (isinstance(experts, torch.nn.Module) and hasattr(gate, "top_k")
                and all(hasattr(experts, w) for w in EXPERT_WEIGHTS)):
            found.append((block, "experts", experts))
    return found


def expert_parallel_problems(section: str, ep: int, ranks: int, *, lora: bool = False,
                             hf_config: dict | None = None) -> list[ConfigProblem]:
    """What makes ``{section}.ep_size=ep`` impossible when it draws from ``ranks`` ranks (the data x
    sequence ranks of one replica; with ``hf_config``, the model's config.json as a dict: for that
    model too)."""
    field = f"{section}.ep_size"
    if ep == 1:
        return []
    problems = []
    if ranks % ep:
        problems.append(ConfigProblem(field, f"does not divide the {ranks} ranks expert parallelism draws from "
                                      f"(the data x sequence ranks of one replica: launch.n_trainer_procs / "
                                      f"({section}.dp_replicate x {section}.tp_size)); pick a divisor", ep))
    if lora:
        problems.append(ConfigProblem(field, f"LoRA adapters ({section}.lora) are not split over expert-parallel "
                                      f"ranks; train LoRA with {field}=1", ep))
    if hf_config is None:
        return problems
    n_experts = hf_config.get("num_experts") or hf_config.get("num_local_experts")
    if not isinstance(n_experts, int) or n_experts <= 0:
        problems.append(ConfigProblem(field, f"the model ({hf_config.get('model_type')!r}) has no experts: expert "
                                      f"parallelism is for mixture-of-experts models; set {field}=1", ep))
    elif n_experts % ep:
        problems.append(ConfigProblem(field, f"does not divide the model's {n_experts} experts per layer; pick a "
                                      "divisor", ep))
    return problems


class _AllToAll(torch.autograd.Function):
    """Rows ``x`` split by ``send`` over the group's ranks, received split by ``recv``; the
    backward sends the gradient the other way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class ExpertShard(torch.nn.Module):
    """This rank's experts of one MoE block, called as the block calls its experts:
    ``(hidden [N, H], top_k_index [N, k], top_k_weights [N, k]) -> [N, H]``."""

    def __init__(self, experts: torch.nn.Module, mesh: DeviceMesh, device: torch.device):
        from torch.distributed.tensor import DTensor, Shard

        super().__init__()
        self.num_experts = int(experts.gate_up_proj.shape[0])
        self.ep = mesh.size()
        self.n_local = self.num_experts // self.ep
        self.first = mesh.get_local_rank() * self.n_local
        self.act_fn = experts.act_fn
        self.group = mesh.get_group()
        for name in EXPERT_WEIGHTS:
            full = getattr(experts, name)
            local = full.detach()[self.first:self.first + self.n_local].to(device).clone()
            param = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            setattr(self, name, torch.nn.Parameter(param, requires_grad=full.requires_grad))

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, expert) pairs by expert: by destination rank
        token, expert = order // k, flat[order]
        send = torch.bincount(expert // self.n_local, minlength=self.ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_l, recv_l = send.tolist(), recv.tolist()
        local_ids = _exchange(expert % self.n_local, send_l, recv_l, self.group)
        x = _AllToAll.apply(hidden[token], send_l, recv_l, self.group)
        y = _AllToAll.apply(self._run_experts(x, local_ids), recv_l, send_l, self.group)
        weighted = y * top_k_weights.reshape(-1)[order, None].to(y.dtype)
        return torch.zeros_like(hidden).index_add(0, token, weighted.to(hidden.dtype))

    def _run_experts(self, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Each received row through its local expert's MLP."""
        gate_up = self.gate_up_proj.to_local().to(x.dtype)
        down = self.down_proj.to_local().to(x.dtype)
        out = x.new_zeros(x.shape)
        if torch.is_grad_enabled():
            # Keep the received rows in the graph even when none came: the backward's all-to-alls
            # are collectives that every rank of the group must join.
            out = out + 0.0 * x.sum()
        for e in range(self.n_local):
            rows = (local_ids == e).nonzero().squeeze(-1)
            if rows.numel() == 0:
                continue
            gate, up = torch.nn.functional.linear(x[rows], gate_up[e]).chunk(2, dim=-1)
            out = out.index_copy(0, rows, torch.nn.functional.linear(self.act_fn(gate) * up, down[e]))
        return out


def apply_expert_parallel(model: torch.nn.Module, ep_mesh: DeviceMesh, device: torch.device) -> set[torch.nn.Parameter]:
    """Replace each MoE block's experts of ``model`` by this rank's `ExpertShard` (on ``device``);
    returns the expert weights, which FSDP2 must leave alone (``ignored_params``)."""
    blocks = moe_experts(model)
    if not blocks:
        raise ValueError(f"expert parallelism: {type(model).__name__} has no mixture-of-experts block")
    params: set[torch.nn.Parameter] = set()
    for block, attr, experts in blocks:
        shard = ExpertShard(experts, ep_mesh, device)
        setattr(block, attr, shard)
        params.update(getattr(shard, name) for name in EXPERT_WEIGHTS)
    return params


def finish_expert_gradients(model: torch.nn.Module, replicas: dist.ProcessGroup | None, loss_scale: int) -> None:
    """After a step's backward: sum the expert gradients of ``model`` over ``replicas`` (the ranks
    holding the same experts) and divide by ``loss_scale``, the ``dp x sp`` ranks FSDP2 averages
    the other gradients over and the engine scales the loss by (`ParallelLayout.fsdp_size`).

    Why that divisor: the sum covers every rank's tokens once (each tensor-parallel rank runs the
    MoE block on its own share of the tokens, `moe_tokens`), each token's gradient carrying the
    loss's scale. An expert weight no token reached gets a zero gradient, so that every rank's
    gradient norm sees it."""
    reduce = replicas is not None and dist.get_world_size(replicas) > 1
    for shard in (m for m in model.modules() if isinstance(m, ExpertShard)):
        for name in EXPERT_WEIGHTS:
            p = getattr(shard, name)
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            local = p.grad.to_local()
            if reduce:
                dist.all_reduce(local, group=replicas)
            local.div_(loss_scale)
