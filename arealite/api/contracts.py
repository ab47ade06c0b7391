"""The typed contracts between arealite's parts.

Each part is written against these Protocols, never against a concrete class, so that a
second backend is one new module that satisfies the same contract:

- `InferenceClient`: generates completions on the inference servers (``agenerate``), with
  pause/resume and versions for the rollout controller. `SGLangClient` is one; a vLLM
  client would be another. Workflows and the rollout controller see only this.
- `WeightUpdateAdmin`: the inference servers' administration routes that a weight
  update needs (pause/continue, load from disk, read back); `DistributedUpdateAdmin`
  adds the update group, `ShmUpdateAdmin` loading from shared memory.
  `arealite.inference_client.sglang_admin.SGLangAdmin` implements all three.
- `TrainEngine`: trains (forward, backward, optimizer step) for any loss it is given
  (a loss sees the model's output as a `HeadOutput`),
  saves and loads checkpoints, exports weights. `FSDPEngine` is one. It does not know
  what GRPO is.
- `WeightSource`: what a weight transfer reads from (a train engine, or a plain state dict).
- `WeightTransfer`: moves one version of the weights to the servers (disk, shm,
  distributed). It implements the transfer only; `WeightPublisher` owns the sequence
  around it (pause → transfer → verify → set the version everywhere → resume).
- `Pausable`: what the publisher pauses around an update (the rollout controller).
- `WeightUpdateTarget`: the rollout side as the publisher sees it (the servers' admin, a
  runner on the client's loop, pause/resume, the version); `RolloutSide` is all of it
  as the trainer sees it.

They are ``runtime_checkable`` so that a constructor can reject a wrong object early with a
message that names what is missing (`require`).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from os import PathLike
from typing import TYPE_CHECKING, Protocol, TypeVar, Union, runtime_checkable

import torch

from arealite.api.types import Completion, GenerationRequest
from arealite.utils.json_types import JsonObject

if TYPE_CHECKING:  # tensordict is slow to import, and only the trainer's side holds batches
    from tensordict import TensorDictBase

_T = TypeVar("_T")

#: What a train engine trains on or scores: right-padded ``[B, L]`` rows by key (at least
#: ``input_ids`` and ``attention_mask``), as a TensorDict or a plain dict of tensors.
TrainBatch = Union["TensorDictBase", Mapping[str, torch.Tensor]]
#: What a loss function logs for its micro-batch: floats or 0-dim tensors by name.
MicroBatchStats = dict[str, Union[float, torch.Tensor]]
#: A packed micro-batch as a loss function or hook sees it: its tensors by key (layout in
#: docs/internals.md) and, under ``"_stats"``, the `MicroBatchStats` the loss logs.
MicroBatch = dict[str, Union[torch.Tensor, MicroBatchStats]]


@runtime_checkable
class HeadOutput(Protocol):
    """The model's output for one packed micro-batch (``T`` tokens), as a loss or hook gets it.

    A causal LM's logits ``[T, V]`` are not materialised unless asked for: ``logprobs`` and
    ``logprobs_entropy`` score ``labels [T]`` under ``log_softmax(logits / temperature)`` in
    float32, with gradients, from the last hidden states in chunks of rows
    (`arealite.train_engine.lm_head.ChunkedHead`). ``logits()`` materialises the float32
    output ``[T, V]`` (``[T, 1]`` for a value model) for a loss that needs all of it.
    """

    def logits(self) -> torch.Tensor: ...

    def logprobs(self, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor: ...

    def logprobs_entropy(self, labels: torch.Tensor,
                         temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]: ...


#: A per-micro-batch loss: ``loss_fn(head, micro_batch) -> 0-dim loss tensor``, ``head`` the
#: micro-batch's `HeadOutput`; stats it wants logged go in ``micro_batch["_stats"]``.
LossFn = Callable[[HeadOutput, MicroBatch], torch.Tensor]
#: The weight of a micro-batch's loss in the step (e.g. its number of loss tokens).
LossWeightFn = Callable[[MicroBatch], float]
#: Turns a micro-batch's `HeadOutput` into the per-token values ``[T]`` `TrainEngine.forward` returns.
PostHook = Callable[[HeadOutput, MicroBatch], torch.Tensor]
#: A checkpointed state (``torch.save``d as it is: tensors and plain Python data).
StateDict = dict[str, object]


class Runner(Protocol):
    """Runs a coroutine on the inference client's event loop from another thread and
    returns its result."""

    def __call__(self, coro: Coroutine[object, object, _T]) -> _T: ...


@runtime_checkable
class InferenceClient(Protocol):
    """Generates completions on inference servers. It only generates.

    A workflow calls ``agenerate`` alone (a test may hand it a stand-in with only that);
    ``pause``/``resume`` hold and release the client's own new submissions (the servers
    are paused by the weight transfer); ``set_version`` tells it the policy version the
    servers hold, which tags every token it returns.
    """

    async def agenerate(self, req: GenerationRequest) -> Completion: ...

    async def initialize(self, timeout: float = 300.0) -> None: ...

    async def aclose(self) -> None: ...

    def get_version(self) -> int: ...

    def set_version(self, version: int) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def stats(self) -> JsonObject: ...


@runtime_checkable
class WeightUpdateAdmin(Protocol):
    """The server administration a weight transfer uses (only trainer rank 0 calls it).

    Every call goes to the servers in rotation; a failure raises an error that names the
    failing servers (``failures: dict[server, cause]``), and `drop_unreachable` takes
    the ones that are gone out of rotation.
    """

    @property
    def healthy_servers(self) -> list[str]: ...

    @property
    def servers(self) -> list[str]: ...

    def server_info(self, addr: str) -> JsonObject: ...

    def out_of_rotation(self) -> dict[str, str]: ...

    async def drop_unreachable(self, addrs: Iterable[str] | None = None, why: str = "") -> list[str]: ...

    async def pause_generation(self, mode: str | None = None) -> JsonObject: ...

    async def continue_generation(self) -> JsonObject: ...

    async def update_weights_from_disk(self, path: str, version: int, timeout: float | None = None) -> JsonObject: ...

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> JsonObject: ...


@runtime_checkable
class DistributedUpdateAdmin(WeightUpdateAdmin, Protocol):
    """Updates over a process group: rank 0 of the trainer broadcasts, every server receives.

    ``begin_weight_update``/``end_weight_update`` bracket an update on servers that have
    them (SGLang >= 0.5.21) and do nothing elsewhere.
    """

    def weights_update_world_size(self) -> int: ...

    def group_members(self, group_name: str) -> list[str]: ...

    async def init_weights_update_group(self, master_address: str, master_port: int,
                                        world_size: int | None = None, group_name: str = ...,
                                        backend: str = "gloo", *, timeout: float | None = None) -> JsonObject: ...

    async def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[torch.dtype | str],
                                              shapes: Sequence[Sequence[int]], group_name: str = ...,
                                              version: int | None = None, flattened_bucket: bool = False, *,
                                              flush_cache: bool = True,
                                              timeout: float | None = None) -> JsonObject: ...

    async def destroy_weights_update_group(self, group_name: str = ...) -> JsonObject: ...

    async def begin_weight_update(self) -> JsonObject: ...

    async def end_weight_update(self) -> JsonObject: ...


@runtime_checkable
class ShmUpdateAdmin(WeightUpdateAdmin, Protocol):
    """Updates from one shared-memory file (servers on the trainer's host)."""

    async def update_weights_from_shm(self, path: str, names: Sequence[str], dtypes: Sequence[torch.dtype | str],
                                      shapes: Sequence[Sequence[int]], offsets: Sequence[int], version: int, *,
                                      timeout: float | None = None, alias: bool = False) -> JsonObject: ...


@runtime_checkable
class TensorUpdateAdmin(WeightUpdateAdmin, Protocol):
    """Updates by tensor handles (servers on the trainer's machine: shared memory or CUDA IPC),
    bracketed like the distributed ones on servers that have sessions."""

    async def update_weights_from_tensor(self, named_tensors: Sequence[tuple[str, torch.Tensor]],
                                         version: int | None, *, flush_cache: bool = True,
                                         load_format: str | None = None,
                                         timeout: float | None = None) -> JsonObject: ...

    async def begin_weight_update(self) -> JsonObject: ...

    async def end_weight_update(self) -> JsonObject: ...


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

    def train_batch(self, batch: TrainBatch, loss_fn: LossFn, loss_weight_fn: LossWeightFn) -> dict[str, float]: ...

    def forward(self, batch: TrainBatch, post_hook: PostHook, out_dtype: torch.dtype = torch.float32) -> torch.Tensor: ...

    def save(self, path: str | PathLike) -> None: ...

    def load(self, path: str | PathLike) -> None: ...

    def export_hf(self, path: str | PathLike) -> None: ...

    def get_version(self) -> int: ...

    def set_version(self, version: int) -> None: ...


@runtime_checkable
class WeightTransfer(Protocol):
    """Moves one version of the weights from a `WeightSource` to every inference server.

    Used on trainer rank 0, which alone talks to the servers; the publisher keeps the
    other ranks reading the source along with it (reading a sharded engine is a
    collective), once more each time the transfer starts reading it anew. Per update:

    - ``stage(source, version)`` while the servers still generate: the work that needs no
      pause (writing the weights to disk or shared memory; nothing for a broadcast);
    - ``transfer(source, version)`` with the servers' generation paused: loads the staged
      weights (or reads ``source`` now) on every server, tagged ``version``, or raises.

    Both return timings and sizes. A transfer neither pauses, continues nor verifies,
    and sets no version: the publisher does. It reads ``source`` in buckets of
    ``bucket_bytes`` (the other ranks read the same buckets).
    """

    @property
    def bucket_bytes(self) -> int: ...

    def init(self) -> None: ...

    def stage(self, source: WeightSource, version: int) -> dict[str, float]: ...

    def transfer(self, source: WeightSource, version: int) -> dict[str, float]: ...

    def close(self) -> None: ...


class Versioned(Protocol):
    """Anything that tags its work with the policy version (engines, client, controller)."""

    def set_version(self, version: int) -> None: ...


@runtime_checkable
class Pausable(Protocol):
    """Stops and restarts admitting new work (the rollout controller around an update)."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...


class Stateful(Protocol):
    """What a checkpoint saves and restores."""

    def state_dict(self) -> StateDict: ...

    def load_state_dict(self, state: StateDict) -> None: ...


@runtime_checkable
class WeightUpdateTarget(Pausable, Versioned, Protocol):
    """The rollout side as the weight publisher sees it: ``admin`` administers the servers,
    ``run`` runs its coroutines on the client's loop; the side is paused around an update
    and gets the new version after it."""

    @property
    def admin(self) -> WeightUpdateAdmin: ...

    @property
    def run(self) -> Runner: ...


@runtime_checkable
class RolloutSide(WeightUpdateTarget, Protocol):
    """The rollout side of one trainer rank as the trainer sees it: client, controller,
    dataloader and workflows together (`arealite.rollout.side.LocalRollout` in the trainer's
    process, `arealite.rollout.worker.RolloutWorker` in a child process).

    What it is to the weight publisher is `WeightUpdateTarget`; ``controller_state``/
    ``loader_state`` serve the checkpointer; ``last_batch_items``/``take_dropped`` the
    per-prompt accounting.
    """

    @property
    def controller_state(self) -> Stateful: ...

    @property
    def loader_state(self) -> Stateful: ...

    @property
    def last_batch_items(self) -> list[JsonObject]: ...

    def start(self, version: int) -> None: ...

    def prepare_batch(self) -> TensorDictBase: ...

    def take_dropped(self) -> list[JsonObject]: ...

    def stats(self) -> dict[str, JsonObject]: ...

    def unfinished_state(self) -> StateDict: ...

    def epochs_handed_out(self) -> int: ...

    def eval_sums(self, items: Sequence[JsonObject], ks: Sequence[int] = ()) -> dict[str, float]: ...

    def stop(self) -> None: ...


def require(obj: object, contract: type, what: str) -> None:
    """Raise a `TypeError` naming the missing methods when `obj` does not satisfy `contract`."""
    if isinstance(obj, contract):
        return
    names = [n for n in dir(contract) if not n.startswith("_") and callable(getattr(contract, n, None))]
    missing = [n for n in names if not hasattr(obj, n)]
    raise TypeError(f"{what} is a {type(obj).__name__}, which does not implement {contract.__name__}"
                    f" (missing: {', '.join(missing) or 'see the Protocol'})")


__all__ = ["DistributedUpdateAdmin", "HeadOutput", "InferenceClient", "LossFn", "LossWeightFn", "MicroBatch",
           "MicroBatchStats", "Pausable", "PostHook", "RolloutSide", "Runner", "ShmUpdateAdmin", "StateDict",
           "Stateful", "TrainBatch", "TrainEngine", "Versioned", "WeightSource", "WeightTransfer",
           "WeightUpdateAdmin", "WeightUpdateTarget", "require"]
