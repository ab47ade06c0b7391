"""The typed contracts between arealite's parts.

Each part is written against these Protocols, never against a concrete class, so that a
second backend is one new module that satisfies the same contract:

- `InferenceClient`: generates (the rollout side). `RemoteSGLangEngine` is one; a vLLM
  client would be another. Workflows and the rollout controller see only this.
- `WeightUpdateAdmin`: the inference servers' administration routes that a weight
  transfer needs (pause/continue, load from disk or shared memory, the update group).
- `TrainEngine`: trains (forward, backward, optimizer step) for any loss it is given,
  saves and loads checkpoints, exports weights. `FSDPEngine` is one. It does not know
  what GRPO is.
- `WeightSource`: what a weight transfer reads from (a train engine, or a plain state dict).
- `WeightTransfer`: moves one version of the weights to the servers (disk, shm,
  distributed). It implements the transfer only; `WeightPublisher` owns the sequence
  around it (pause → transfer → verify → set the version everywhere → resume).

They are ``runtime_checkable`` so that a constructor can reject a wrong object early with a
message that names what is missing (`require`).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterator
from os import PathLike
from typing import Any, Protocol, runtime_checkable

import torch

from arealite.api.types import Completion, GenerationRequest

#: A per-micro-batch loss: ``loss_fn(logits, micro_batch) -> (scalar loss, stats)``.
LossFn = Callable[[torch.Tensor, dict[str, Any]], tuple[torch.Tensor, dict[str, float]]]
#: The weight of a micro-batch's loss in the step (e.g. its number of loss tokens).
LossWeightFn = Callable[[dict[str, Any]], float]
#: Turns a micro-batch's logits into the per-token values `TrainEngine.forward` returns.
PostHook = Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]
#: Runs a coroutine on the inference client's event loop from another thread, returns its result.
Runner = Callable[[Coroutine[Any, Any, Any]], Any]


@runtime_checkable
class InferenceClient(Protocol):
    """Generates completions on inference servers. It only generates.

    ``pause``/``resume`` hold and release the client's own new submissions (the servers
    are paused by the weight transfer); ``set_version`` tells it the policy version the
    servers hold, which tags every token it returns.
    """

    async def initialize(self, timeout: float = 300.0) -> None: ...

    async def aclose(self) -> None: ...

    async def agenerate(self, req: GenerationRequest) -> Completion: ...

    def get_version(self) -> int: ...

    def set_version(self, version: int) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...


@runtime_checkable
class WeightUpdateAdmin(Protocol):
    """The server administration a weight transfer uses (only trainer rank 0 calls it).

    Every call goes to the servers in rotation; a failure raises an error that names the
    failing servers (``failures: dict[server, cause]``), and `drop_unreachable` takes
    the ones that are gone out of rotation.
    """

    @property
    def healthy_servers(self) -> list[str]: ...

    async def drop_unreachable(self, addrs: Any = None, why: str = "") -> list[str]: ...

    async def pause_generation(self) -> dict[str, Any]: ...

    async def continue_generation(self) -> dict[str, Any]: ...

    async def update_weights_from_disk(self, path: str, version: int, timeout: float | None = None) -> dict[str, Any]: ...

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> dict[str, Any]: ...


@runtime_checkable
class WeightSource(Protocol):
    """Something whose weights can be read in buckets of HF-named tensors.

    Iterating is a collective on a sharded engine: every trainer rank iterates.
    """

    def named_weight_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]: ...


@runtime_checkable
class TrainEngine(WeightSource, Protocol):
    """Trains a model on micro-batches for whatever loss it is given."""

    def initialize(self, total_steps: int | None = None) -> "TrainEngine": ...

    def destroy(self) -> None: ...

    def train_batch(self, batch: Any, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> dict[str, float]: ...

    def forward(self, batch: Any, post_hook: PostHook, out_dtype: torch.dtype = torch.float32) -> torch.Tensor: ...

    def save(self, path: str | PathLike) -> None: ...

    def load(self, path: str | PathLike) -> None: ...

    def export_hf(self, path: str | PathLike) -> None: ...

    def get_version(self) -> int: ...

    def set_version(self, version: int) -> None: ...


@runtime_checkable
class WeightTransfer(Protocol):
    """Moves one version of the weights from a `WeightSource` to every inference server.

    Called on every trainer rank (reading a sharded engine is collective); only rank 0
    talks to the servers. ``transfer`` runs with the servers' generation paused and must
    leave them loaded with ``version`` (verified) or raise; it returns timings and sizes.
    """

    def init(self) -> None: ...

    def transfer(self, source: WeightSource, version: int) -> dict[str, float]: ...

    def close(self) -> None: ...


class Versioned(Protocol):
    """Anything that tags its work with the policy version (engines, client, controller)."""

    def set_version(self, version: int) -> None: ...


def require(obj: Any, contract: type, what: str) -> None:
    """Raise a `TypeError` naming the missing methods when `obj` does not satisfy `contract`."""
    if isinstance(obj, contract):
        return
    names = [n for n in dir(contract) if not n.startswith("_") and callable(getattr(contract, n, None))]
    missing = [n for n in names if not hasattr(obj, n)]
    raise TypeError(f"{what} is a {type(obj).__name__}, which does not implement {contract.__name__}"
                    f" (missing: {', '.join(missing) or 'see the Protocol'})")


__all__ = ["InferenceClient", "LossFn", "LossWeightFn", "PostHook", "Runner", "TrainEngine",
           "Versioned", "WeightSource", "WeightTransfer", "WeightUpdateAdmin", "require"]
