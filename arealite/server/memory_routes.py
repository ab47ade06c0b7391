"""The embedded server's ``/release_memory_occupation`` and ``/resume_memory_occupation``.

As SGLang 0.5.21 (``entrypoints/http_server.py``; ``managers/scheduler_components/
weight_updater.py`` ``release_memory_occupation`` / ``resume_memory_occupation``;
docs/sglang.md, "Memory release"): the body is ``{"tags": [...]}``, tags among
``weights``, ``kv_cache``, ``cuda_graph``, none or empty meaning all three; a success
answers 200 with a JSON ``null``; a failure ``{"error": {"message"}}``.

- **kv_cache**: the prompt cache is dropped (the running batch's cache exists only while
  requests run, and SGLang requires an idle server); **weights**: `ReleasedWeights`;
  **cuda_graph**: nothing to free here.
- While anything is released no request is admitted: requests wait as they would while
  paused, until everything is resumed. (SGLang leaves this to the caller: it pauses
  generation first, else the scheduler runs a batch on unmapped memory.)
- **Strict mode** refuses what SGLang cannot do or dies of: a release without
  ``--enable-memory-saver`` (SGLang answers 200 and frees nothing, which a CPU run would
  never notice); a release while requests run (SGLang's scheduler asserts it is idle and
  the server dies); a resume of a tag not released (its ``offload_tags.remove`` raises
  ``KeyError``, again fatal); a second release of a tag; and a ``/generate`` that arrives
  while memory is released and generation is not paused.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Awaitable, Callable

import torch
from aiohttp import web

from .body import RequestError, error_response, json_body
from .limits import short
from .memory_saver import ReleasedWeights, process_rss_bytes, return_freed_heap
from .strict import SGLangBehaviour

if TYPE_CHECKING:
    from .runner_contract import GenerationRunner

logger = logging.getLogger("arealite.server")

#: SGLang's memory tags (``srt/constants.py`` ``GPU_MEMORY_ALL_TYPES``), in its order.
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")

NO_MEMORY_SAVER = ("release_memory_occupation needs the server started with --enable-memory-saver "
                   "(server.enable_memory_saver: true): without it SGLang answers 200 and frees nothing")
NOT_IDLE = ("release_memory_occupation should be called only when server is idle: {n} request(s) are running; "
            "call pause_generation (mode 'abort') first (SGLang's scheduler dies on this assertion)")


class MemoryRefused(Exception):
    """A release or resume the server refuses (answered 400 with SGLang's error shape)."""


class MemoryRoutes:
    """Release and resume of one served model's weights and KV cache."""

    def __init__(self, model: torch.nn.Module, runner: GenerationRunner, *, behaviour: SGLangBehaviour,
                 memory_saver: bool, weights_cpu_backup: bool, own_weights: Callable[[], None]):
        """``own_weights``: gives every parameter storage of its own (copies those that map a file)."""
        self.runner = runner
        self.own_weights = own_weights
        self.behaviour = behaviour
        self.memory_saver = memory_saver
        self.weights = ReleasedWeights(model, cpu_backup=weights_cpu_backup)
        self.released: set[str] = set()
        #: What the last release freed, by tag, in bytes (reported by /server_info).
        self.freed_bytes: dict[str, int] = {}

    def routes(self) -> dict[str, Callable[[web.Request], Awaitable[web.Response]]]:
        """Path -> handler (SGLang serves both GET and POST)."""
        return {"/release_memory_occupation": self.release_memory_occupation,
                "/resume_memory_occupation": self.resume_memory_occupation}

    @property
    def weights_released(self) -> bool:
        """Whether the weights have no memory now (updates into them are refused)."""
        return "weights" in self.released

    def check_generate(self, paused: bool) -> None:
        """Strict mode: refuse a request arriving while memory is released and generation
        is not paused (SGLang would run it on released memory)."""
        if self.behaviour.strict and self.released and not paused:
            raise RequestError(
                f"generate: the server's {sorted(self.released)} memory is released and generation is not paused; "
                "SGLang would run this request on released memory. Call pause_generation before "
                "release_memory_occupation and continue_generation after resume_memory_occupation")

    def status(self) -> dict:
        """What /server_info reports: the released tags and the bytes the last release freed."""
        out = {"released": sorted(self.released), "freed_bytes": dict(self.freed_bytes),
               "memory_saver": self.memory_saver, "rss_bytes": process_rss_bytes()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda_memory_allocated"] = torch.cuda.memory_allocated()
        return out

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        tags = await self._tags(request, "release_memory_occupation")
        if self.behaviour.strict and not self.memory_saver:
            return error_response(NO_MEMORY_SAVER)
        if self.behaviour.strict and self.released & set(tags):
            return error_response(f"release_memory_occupation: {sorted(self.released & set(tags))} already "
                                  "released; resume_memory_occupation first")
        try:
            freed = await self.runner.call(lambda: self._release(tags))
        except (MemoryRefused, RuntimeError) as e:
            logger.warning("release_memory_occupation(%s) refused: %s", tags, e)
            return error_response(str(e))
        self.freed_bytes = freed
        logger.info("released %s: %s bytes; RSS now %d", tags, freed, process_rss_bytes())
        return self._answer(f"released {sorted(freed)}", freed)

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        tags = await self._tags(request, "resume_memory_occupation")
        missing = [t for t in tags if t not in self.released]
        if missing and self.behaviour.strict:
            return error_response(
                f"resume_memory_occupation: {missing} were not released (SGLang's scheduler dies on the "
                f"KeyError); released now: {sorted(self.released)}")
        tags = [t for t in tags if t in self.released]
        restored = await self.runner.call(lambda: self._resume(tags))
        return self._answer(f"resumed {sorted(restored)}", restored)

    def _answer(self, message: str, sizes: dict[str, int]) -> web.Response:
        if self.behaviour.strict:
            return web.json_response(None)  # SGLang's route returns nothing: FastAPI answers null
        return web.json_response({"success": True, "message": message, "bytes": sizes,
                                  "released": sorted(self.released)})

    async def _tags(self, request: web.Request, route: str) -> list[str]:
        body = await json_body(request, allow_empty=True)
        tags = body.get("tags") if isinstance(body, dict) else None
        if tags is None or tags == []:
            return list(MEMORY_TAGS)
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            raise RequestError(f"{route}: tags must be a list of strings, got {short(tags)}")
        unknown = [t for t in tags if t not in MEMORY_TAGS]
        if unknown:
            raise RequestError(f"{route}: unknown tags {short(unknown)}; SGLang's are {list(MEMORY_TAGS)}")
        return list(dict.fromkeys(tags))

    # -- on the model thread ------------------------------------------------

    def _release(self, tags: list[str]) -> dict[str, int]:
        t0 = time.perf_counter()
        n = self.runner.n_running
        if n:
            raise MemoryRefused(NOT_IDLE.format(n=n))
        freed: dict[str, int] = {}
        if "kv_cache" in tags and "kv_cache" not in self.released:
            freed["kv_cache"] = int(getattr(self.runner.prompt_cache, "nbytes", 0))
            self.runner.prompt_cache.clear()
            return_freed_heap()
        if "weights" in tags and "weights" not in self.released:
            if not self.weights.resizable():
                self.own_weights()  # a mapped checkpoint cannot be freed in place: copy it once
            freed["weights"] = self.weights.release()
        if "cuda_graph" in tags:
            freed["cuda_graph"] = 0
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # freed blocks back to the driver, where the trainer can have them
        self.released.update(tags)
        self.runner.pause.released = True
        logger.debug("release took %.3fs", time.perf_counter() - t0)
        return freed

    def _resume(self, tags: list[str]) -> dict[str, int]:
        restored: dict[str, int] = {}
        if "weights" in tags:
            restored["weights"] = self.weights.restore()
        for t in tags:
            restored.setdefault(t, 0)
        self.released.difference_update(tags)
        self.runner.pause.released = bool(self.released)
        return restored
