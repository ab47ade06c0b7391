"""What the embedded server's routes ask of the runner that generates, and what it gives back.

Two runners fill the server's runner slot: `ModelRunner` (``server/runner.py``: a Hugging
Face model on a thread of its own) and `arealite.sim.runner.SimRunner` (a GPU cost model
on the event loop, ``python -m arealite.sim``). The routes only use `GenerationRunner`:
queue a sequence and await it (`Sequence`), run a command between two steps, pause,
abort, shut down, and read a few counters. `PauseState` is the pause bookkeeping both
runners keep, written once here.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, TypeVar

import torch

from arealite.config.weight_sync import PAUSE_MODES
from arealite.utils.json_types import JsonObject

from .generate_request import GenerateInput

__all__ = ["PAUSE_MODES", "GenerationRunner", "PauseState", "PromptCacheCounts", "RunnerFactory", "Sequence",
           "record_version_change", "weight_version_spans"]

T = TypeVar("T")

#: The finish message of every request a pause in mode "abort" returns.
PAUSE_ABORT_MESSAGE = "generation paused (pause_generation, mode abort)"


@dataclass
class Sequence:
    """A request in the engine: its prompt, what it produced, where to deliver it."""

    inp: GenerateInput
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    stop_ids: frozenset[int]
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[list]] | None = None
    """Per generated token, ``[logprob, id, None]`` of the most likely tokens (``top_logprobs_num``)."""
    input_logprobs: list[float | None] | None = None
    """SGLang's ``input_token_logprobs`` values from ``logprob_start_len`` (None: not asked)."""
    routed_experts: list[torch.Tensor] = field(default_factory=list)
    """With ``return_routed_experts``: ``[n, layers, k]`` int32 chunks, one row per token forwarded
    (the prompt, then each generated token but the last), in order."""
    finish_reason: JsonObject | None = None
    cached_tokens: int = 0
    """Prompt tokens not computed for this sequence: shared with another of its prefill."""
    weight_version: str = ""
    version_events: list[tuple[str, int]] = field(default_factory=list)
    """Each weight change while it ran: (the version before, how many output tokens it had
    made then); `weight_version_spans` turns them into SGLang's ``meta_info.weight_versions``."""
    start_time: float = field(default_factory=time.perf_counter)
    end_time: float = 0.0




def record_version_change(made: list[tuple[Sequence, int]], old_version: str) -> None:
    """Note on each live sequence that the weights changed after it made ``n`` tokens (SGLang's
    ``record_weight_version_events``: sequences that made none are skipped)."""
    for seq, n in made:
        if n:
            seq.version_events.append((old_version, n))


def weight_version_spans(seq: Sequence) -> list[JsonObject]:
    """``meta_info.weight_versions`` of a finished sequence: which version sampled which output
    tokens, as ``{version, start, end}`` spans (SGLang's ``compute_weight_version_spans``)."""
    n_out = len(seq.output_ids)
    spans: list[JsonObject] = []
    for version, end in [*seq.version_events, (seq.weight_version, n_out)]:
        end = min(end, n_out)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return spans


class PauseState:
    """Whether a runner admits new sequences and steps the running ones.

    SGLang's ``/pause_generation`` stops admission; in mode ``abort`` every request returns
    at once; in mode ``retract`` the running requests go back to the waiting queue, their KV
    dropped (recomputed at their next prefill); in mode ``in_place`` the running batch is frozen
    where it is, its KV kept. ``/continue_generation`` lifts all three. A
    ``begin/end_weight_update`` bracket stops admission without pausing, and so does memory
    released by ``/release_memory_occupation`` until it is resumed.
    """

    paused: bool
    mode: str
    """The last pause's mode: ``abort``, ``retract`` or ``in_place``."""
    in_update_bracket: bool
    released: bool
    """Weights or KV cache released (``/release_memory_occupation``): nothing may run."""

    def __init__(self) -> None:
        self.paused = False
        self.mode = "abort"
        self.in_update_bracket = False
        self.released = False

    @property
    def admits(self) -> bool:
        """Whether waiting sequences may join the batch."""
        return not self.paused and not self.in_update_bracket and not self.released

    @property
    def freezes_running(self) -> bool:
        """Whether the running sequences must not step (an ``in_place`` pause)."""
        return self.paused and self.mode == "in_place"

    @property
    def holds_old_kv(self) -> bool:
        """Whether the server is paused in place with KV of the current weights kept (SGLang then
        cannot flush its cache: a weight load that asks for a flush fails)."""
        return self.paused and self.mode == "in_place"

    def set(self, runner: GenerationRunner, paused: bool, mode: str = "abort") -> int:
        """Pause (in ``mode``) or continue ``runner``; returns how many sequences were running.

        SGLang's abort mode is ``abort_request(abort_all=True)``: the scheduler drops its waiting
        queue as well as finishing the running batch, so every request in the server returns
        (the waiting ones with no output) and none starts on the weights about to be replaced.
        Retract (SGLang's ``Scheduler.pause_generation``) puts the running ones back in the queue.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}: expected one of {', '.join(PAUSE_MODES)}")
        n = runner.n_running
        self.paused = paused
        if paused:
            self.mode = mode
            if mode == "abort":
                runner.abort(None, PAUSE_ABORT_MESSAGE)
            elif mode == "retract":
                runner.retract_running()
        return n


class PromptCacheCounts(Protocol):
    """The prompt cache as the routes see it: its size, its counters, and a flush."""

    hits: int
    misses: int

    def __len__(self) -> int: ...

    def clear(self) -> int: ...


class GenerationRunner(Protocol):
    """What `EmbeddedServer` and its routes call on the runner in their slot.

    ``generate`` runs on the event loop; every other method but ``shutdown`` runs through
    ``call``, between two steps, so that it never races the batch.
    """

    weight_version: str
    pause: PauseState
    stats: dict[str, float]
    """Counters reported by ``/server_info`` (``internal_states``)."""
    prompt_cache: PromptCacheCounts
    lora: object | None
    """The server's LoRA adapters (`arealite.server.lora_adapters.LoraSet`), set by its routes."""

    @property
    def n_running(self) -> int: ...

    @property
    def n_waiting(self) -> int: ...

    async def generate(self, inp: GenerateInput) -> Sequence:
        """Queue one sequence and wait for it to finish (or be aborted)."""
        ...

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` between two steps and return its result."""
        ...

    def set_paused(self, paused: bool, mode: str = "abort") -> int:
        """Pause admission (and abort or freeze running sequences); returns how many were running."""
        ...

    def abort(self, rid_prefix: str | None, message: str) -> int:
        """Abort running and waiting requests whose rid starts with the prefix (all when None)."""
        ...

    def retract_running(self) -> int:
        """Put every running sequence back at the head of the queue, its KV dropped (it is
        recomputed over prompt + output at its next prefill); returns how many."""
        ...

    def shutdown(self) -> None:
        """Stop; unfinished requests are aborted."""
        ...


#: What `EmbeddedServer` takes as ``runner_class``: called with `ModelRunner`'s arguments.
RunnerFactory = Callable[..., GenerationRunner]
