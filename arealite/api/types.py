"""The few typed concepts every part of arealite speaks.

- ``SamplingParams``: how to sample one request. Per call, so that training
  sampling and greedy evaluation go through the same engine.
- ``GenerationRequest``: one prompt (token ids) to complete.
- ``Completion``: what an inference engine returns for one request. It carries
  no reward and no group: the generator only generates.
- ``TRAJECTORY_KEYS`` / ``validate_trajectory``: the flat TensorDict a workflow
  hands the trainer (see docs/architecture.md for the schema);
  ``mark_well_formed`` lets a trajectory builder vouch for its per-token tensors.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import torch

from arealite.utils.json_types import JsonObject

if TYPE_CHECKING:
    from tensordict import TensorDictBase


@dataclass
class SamplingParams:
    """Sampling parameters of one generation request.

    ``greedy=True`` forces temperature 0 (argmax decoding), whatever
    ``temperature`` says; evaluation uses it as a per-call override.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    greedy: bool = False

    def replace(self, **overrides: int | float | bool | list[int]) -> "SamplingParams":
        """A copy with some fields changed (e.g. ``greedy=True`` for evaluation)."""
        unknown = set(overrides) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(
                f"unknown sampling parameter(s) {sorted(unknown)}; "
                f"allowed: {[f.name for f in dataclasses.fields(self)]}"
            )
        return dataclasses.replace(self, **overrides)

    def to_sglang(self) -> JsonObject:
        """The ``sampling_params`` object of SGLang's ``/generate`` route."""
        out: JsonObject = {
            "max_new_tokens": int(self.max_new_tokens),
            "temperature": 0.0 if self.greedy else float(self.temperature),
            "top_p": float(self.top_p),
            "top_k": int(self.top_k),
        }
        if self.min_p:
            out["min_p"] = float(self.min_p)
        if self.stop_token_ids:
            out["stop_token_ids"] = [int(t) for t in self.stop_token_ids]
        if self.ignore_eos:
            out["ignore_eos"] = True
        return out


@dataclass
class GenerationRequest:
    """One prompt to complete.

    ``affinity_key``: requests sharing it (the samples of one group, the turns
    of one conversation) go to the same server, for prefix-cache reuse.
    """

    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    affinity_key: str | None = None
    metadata: dict[str, object] = field(default_factory=dict)
    top_logprobs: int = 0
    """How many of the most likely tokens to report at each generated position (0: none)."""
    image_data: list[str] | None = None
    """Vision-language prompts: base64 of each image's encoded file bytes, in the order of the
    prompt's image placeholders; ``input_ids`` is then the EXPANDED prompt (one ``<|image_pad|>``
    per merged patch, as the model's processor renders it). None: a text-only prompt (docs/vision.md)."""


@dataclass
class Completion:
    """What an inference engine returns for one request.

    ``output_logprobs[i]`` is the behaviour log-prob of ``output_ids[i]``
    (``log_softmax(logits / T)``), ``output_versions[i]`` the policy version
    that produced it. After an interrupted generation the tokens may carry
    several versions.
    """

    rid: str
    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    latency_s: float = 0.0
    server: str = ""
    n_interruptions: int = 0
    output_top_logprobs: list[list[tuple[int, float]]] | None = None
    """With ``GenerationRequest.top_logprobs`` > 0: per output token, (id, log-prob) of the most
    likely tokens of the same distribution, likeliest first."""
    routed_experts: torch.Tensor | None = None
    """Mixture-of-experts routing the server reported (``return_routed_experts``): int32
    ``[len(input_ids) + len(output_ids) - 1, n_moe_layers * top_k]``; row t holds the experts token t
    was routed to at each layer (the last token was never run forward). After an interruption each
    row keeps the segment that first ran it, as each token keeps its version. None: not asked."""

    @property
    def all_ids(self) -> list[int]:
        return list(self.input_ids) + list(self.output_ids)


# --------------------------------------------------------------------------
# The trajectory: one flat TensorDict, batch dims [B, L], right-padded.
# --------------------------------------------------------------------------

#: key -> (dtype, per-token?) ; per-token keys are [B, L], the others [B].
TRAJECTORY_KEYS: dict[str, tuple[torch.dtype, bool]] = {
    "input_ids": (torch.int64, True),
    "attention_mask": (torch.bool, True),
    "loss_mask": (torch.bool, True),
    "logprobs": (torch.float32, True),
    "versions": (torch.int64, True),
    "rewards": (torch.float32, False),
    "group_id": (torch.int64, False),
}


#: The per-token keys, in the order ``mark_well_formed`` takes their tensors.
PER_TOKEN_KEYS = tuple(k for k, (_, per_token) in TRAJECTORY_KEYS.items() if per_token)
#: The per-row keys (``[B]``).
PER_ROW_KEYS = tuple(k for k, (_, per_token) in TRAJECTORY_KEYS.items() if not per_token)
_NO_ATTRS: dict[str, object] = {}
_TensorDictBase: type | None = None  # imported on first use: tensordict is heavy to import
# Where mark_well_formed keeps the vouched tensors: an instance attribute of the TensorDict.
_WELL_FORMED = "_arealite_well_formed"
_TD = TypeVar("_TD", bound="TensorDictBase")


class TrajectoryError(ValueError):
    """A workflow produced a malformed trajectory."""


def _write_count(per_token: tuple[torch.Tensor, ...]) -> int:
    """How many in-place writes the five per-token tensors have had, summed.

    The counts only grow, so an unchanged sum means none was written to. torch keeps
    them only in the private version counter autograd uses to catch in-place edits.
    It is what lets a vouched group skip the per-token checks, which saves 14-21 us of
    loop CPU per trajectory (11-22%) on bench_workflow_cpu's RLVR run (with and without,
    interleaved in one process, medians of 10 and of 30 rounds).
    """
    ids, am, lm, lp, ve = per_token
    return ids._version + am._version + lm._version + lp._version + ve._version  # private-ok: torch has no public one


def mark_well_formed(td: _TD, per_token: tuple[torch.Tensor, ...]) -> _TD:
    """Vouch that ``td``'s per-token tensors are well-formed by construction; return ``td``.

    For trajectory builders on the rollout hot path (one call per group), whose
    per-token tensors are consistent by how they are built. ``per_token`` are
    the tensors of ``PER_TOKEN_KEYS``, in that order. ``validate_trajectory``
    then skips its per-token checks for ``td`` as long as it still holds these
    very tensors, not modified in place since this call; per-row keys (rewards,
    group ids) are always checked.
    """
    setattr(td, _WELL_FORMED, (per_token, _write_count(per_token)))
    return td


def _still_vouched(td: TensorDictBase, found: dict[str, object], B: int) -> bool:
    """Whether ``td``'s builder vouched for it (``mark_well_formed``) and it still holds
    the very per-token tensors vouched for, not written to since."""
    built = getattr(td, "__dict__", _NO_ATTRS).get(_WELL_FORMED)
    if built is None:
        return False
    tensors, writes = built
    ids, am, lm, lp, ve = tensors
    get = found.get
    return (get("input_ids") is ids and get("attention_mask") is am and get("loss_mask") is lm
            and get("logprobs") is lp and get("versions") is ve and ids.shape[0] == B
            and _write_count(tensors) == writes)


def validate_trajectory(td: object, where: str = "trajectory") -> None:
    """Check a workflow's TensorDict against the schema; raise naming the key.

    Extra keys are allowed (workflows may add per-step rewards, turn ids...).
    Runs once per group on the rollout hot path, so shapes and dtypes are
    checked in plain Python and the value checks cost two tensor ops at most.
    """
    global _TensorDictBase
    if _TensorDictBase is None:
        from tensordict import TensorDictBase as _TensorDictBase
    if not isinstance(td, _TensorDictBase):
        raise TrajectoryError(
            f"{where}: expected a TensorDict (or None to reject), got {type(td).__name__}"
        )
    batch_size = td.batch_size
    if not batch_size:
        raise TrajectoryError(f"{where}: the TensorDict needs a batch dimension [B]")
    B = batch_size[0]
    L = None
    # One pass: TensorDict.get costs ~0.5 us per key. (TensorDict's private key dict
    # would save another ~0.6 us: not measurable on bench_workflow_cpu.)
    found = dict(td.items())
    vouched = _still_vouched(td, found, B)
    keys: Iterable[str] = PER_ROW_KEYS if vouched else TRAJECTORY_KEYS
    for key in keys:
        dtype, per_token = TRAJECTORY_KEYS[key]
        t = found.get(key)
        if t is None:
            raise TrajectoryError(f"{where}: missing key '{key}' (required: {sorted(TRAJECTORY_KEYS)})")
        if not isinstance(t, torch.Tensor):
            raise TrajectoryError(f"{where}: key '{key}' holds a {type(t).__name__}, expected a tensor")
        if t.dtype != dtype:
            raise TrajectoryError(f"{where}: key '{key}' has dtype {t.dtype}, expected {dtype}")
        shape = t.shape
        if per_token:
            if len(shape) != 2 or shape[0] != B:
                raise TrajectoryError(
                    f"{where}: key '{key}' has shape {tuple(shape)}, expected [B={B}, L]"
                )
            if L is None:
                L = shape[1]
            elif shape[1] != L:
                raise TrajectoryError(
                    f"{where}: key '{key}' has length {shape[1]}, but input_ids has length {L}"
                )
        elif len(shape) != 1 or shape[0] != B:
            raise TrajectoryError(f"{where}: key '{key}' has shape {tuple(shape)}, expected [B={B}]")
    # loss_mask must imply attention_mask: on bools, True > False is exactly "loss outside attention".
    if not vouched and (found["loss_mask"] > found["attention_mask"]).any():
        raise TrajectoryError(f"{where}: key 'loss_mask' marks tokens outside 'attention_mask'")
    rewards = found["rewards"]
    # A group's few rewards are checked faster in Python than with two tensor ops.
    finite = all(map(math.isfinite, rewards.tolist())) if B <= 256 else bool(torch.isfinite(rewards).all())
    if not finite:
        raise TrajectoryError(f"{where}: key 'rewards' holds NaN or inf")
