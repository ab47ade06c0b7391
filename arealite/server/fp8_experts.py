"""The embedded server's FP8 mixture-of-experts layers (``--quantization fp8`` on an MoE model).

Transformers keeps a layer's experts fused (``experts.gate_up_proj [E, 2I, H]``,
``experts.down_proj [E, H, I]``); an FP8 checkpoint, SGLang's ``Fp8MoEMethod`` and the
trainer's pushes block-quantise each expert's projection on its own, under the checkpoint's
names (``experts.{e}.gate_proj.weight`` + ``...weight_scale_inv``, ``up_proj``, ``down_proj``).
`Fp8Experts` stores them so: one `Fp8Linear` per expert and projection, whose state-dict
names are exactly those, so weight updates address them as they address any FP8 weight.
Its forward is the fused layer's (the same routing, the same weighted sum), each hit
expert multiplying through its `Fp8Linear`s. The router (``mlp.gate``) is not touched: it
stays in the server's dtype, and routing capture and replay (R3) see it as before.
"""

from __future__ import annotations

import torch

from arealite.server.fp8_linear import Fp8Linear
from arealite.utils.checkpoint_names import checkpoint_views

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class Fp8Experts(torch.nn.ModuleList):
    """``E`` experts, each ``down(act(gate(x)) * up(x))`` with FP8 projections; a list of
    experts, so that their tensors are named ``{e}.{proj}.weight`` as in the checkpoint."""

    def __init__(self, experts: list[torch.nn.Module], act_fn):
        super().__init__(experts)
        self.act_fn = act_fn
        self.num_experts = len(experts)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e in torch.unique(top_k_index).tolist():
            if not 0 <= e < self.num_experts:  # a replayed -1 or a padding id picks no expert
                continue
            token_idx, pos = torch.where(top_k_index == e)
            x = hidden_states[token_idx]
            expert = self[e]
            h = expert.down_proj(self.act_fn(expert.gate_proj(x)) * expert.up_proj(x))
            out.index_add_(0, token_idx, (h * top_k_weights[token_idx, pos, None]).to(out.dtype))
        return out


def _fp8_projection(w: torch.Tensor) -> Fp8Linear:
    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
    linear.weight = torch.nn.Parameter(w.detach(), requires_grad=False)
    return Fp8Linear(linear)


def quantize_experts(model: torch.nn.Module) -> list[str]:
    """Replace every fused experts module (3-D ``gate_up_proj`` and ``down_proj``) by an
    `Fp8Experts` quantised expert by expert; return the replaced modules' names."""
    targets = [(name, mod) for name, mod in model.named_modules()
               if isinstance(getattr(mod, "gate_up_proj", None), torch.Tensor) and mod.gate_up_proj.dim() == 3
               and isinstance(getattr(mod, "down_proj", None), torch.Tensor) and mod.down_proj.dim() == 3]
    for name, mod in targets:
        views = checkpoint_views(model, {f"{name}.{p}": t for p, t in mod.named_parameters(recurse=False)})
        experts = []
        for e in range(mod.gate_up_proj.shape[0]):
            expert = torch.nn.Module()
            for proj in _PROJECTIONS:
                key = f"{name}.{e}.{proj}.weight"
                if key not in views:
                    raise ValueError(f"fp8: cannot find expert weight {key!r} in the checkpoint layout of {name!r}")
                setattr(expert, proj, _fp8_projection(views[key]))
            experts.append(expert)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, Fp8Experts(experts, mod.act_fn))
    return [name for name, _ in targets]
