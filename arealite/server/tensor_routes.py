"""The embedded server's ``/update_weights_from_tensor``: weights handed over by handle.

SGLang 0.5.21's payload (``managers/io_struct.py`` ``UpdateWeightsFromTensorReqInput``):
``serialized_named_tensors``, one entry per tensor-parallel rank, each a base64 pickle of
``[(name, tensor), ...]`` made with torch's multiprocessing reductions (shared memory on
CPU, CUDA IPC on a GPU; `arealite.utils.tensor_handles`); ``load_format`` (None, or
``direct`` to copy without the model's name mapping; ``flattened_bucket`` and custom
loaders are not supported here); ``flush_cache`` (default true); ``weight_version``;
``abort_all_requests``. Each rank unpickles only its own entry. The answer is
``{"success", "message"}``, 400 on failure. From 0.5.21 it must run inside a
``begin_weight_update`` / ``end_weight_update`` session, like the distributed update.

The tensors are checked against the model (names, shapes, dtypes) before anything is
copied, so a refused update leaves the old weights serving; then they are copied into
the model between two decode steps and the mapping is dropped.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from aiohttp import web

from arealite.utils.tensor_handles import TensorPayloadError, decode_named_tensors

from .body import RequestError, check_fields, json_body, want
from .limits import short
from .weights import check_metadata, copy_into_model

if TYPE_CHECKING:
    from .memory_routes import MemoryRoutes
    from .weight_routes import WeightRoutes

logger = logging.getLogger("arealite.server")

ROUTE = "update_weights_from_tensor"
OUTSIDE_SESSION = f"{ROUTE} must run between begin_weight_update() and end_weight_update()"
#: The embedded server is one tensor-parallel rank (``tp_size`` 1 in ``/server_info``).
TP_SIZE = 1


class TensorRoutes:
    """``/update_weights_from_tensor`` over a server's weight routes (session, load)."""

    def __init__(self, weights: WeightRoutes, memory: MemoryRoutes):
        self.weights = weights
        self.memory = memory
        self.mapped: list = []  # the last push's tensors (the sender's memory, mapped)

    def routes(self) -> dict:
        """POST path -> handler."""
        return {"/" + ROUTE: self.update_weights_from_tensor}

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        check_fields(body, {"serialized_named_tensors"},
                     {"load_format", "flush_cache", "abort_all_requests", "weight_version", "selector",
                      "torch_empty_cache"}, ROUTE)
        entries = body["serialized_named_tensors"]
        if not isinstance(entries, list) or not entries:
            raise RequestError(f"{ROUTE}: serialized_named_tensors must be a non-empty list with one entry per "
                               f"tensor-parallel rank (this server has tp_size {TP_SIZE}), got {short(entries)}")
        if self.weights.behaviour.strict and len(entries) != TP_SIZE:
            raise RequestError(f"{ROUTE}: serialized_named_tensors has {len(entries)} entries; SGLang reads entry "
                               f"[tp_rank] of each rank and this server has tp_size {TP_SIZE}: send one per rank")
        fmt = want(body, "load_format", str, ROUTE)
        if fmt not in (None, "direct"):
            raise RequestError(f"{ROUTE}: load_format {short(fmt)} is not supported here (None or 'direct'; "
                               "SGLang would import a custom loader by that name or fail)")
        self.weights.check_flush(body, ROUTE)
        abort_all = want(body, "abort_all_requests", bool, ROUTE, False)
        version = self.weights.version_of(body, ROUTE)
        if self.weights.behaviour.has_sessions and not self.weights.session_open:
            logger.warning("%s refused: %s", ROUTE, OUTSIDE_SESSION)
            return web.json_response({"success": False, "message": OUTSIDE_SESSION}, status=400)
        if self.memory.weights_released:
            return web.json_response({"success": False, "message": (
                f"{ROUTE}: the weights are released; call resume_memory_occupation(tags=['weights']) first")},
                status=400)
        if abort_all:
            await self.weights.runner.call(lambda: self.weights.runner.abort(None, "aborted for a weight update"))

        t0 = time.perf_counter()
        try:
            # On the loop: mapping costs no page faults yet (those come with the copy), and a
            # thread hop costs more than the unpickling.
            named = decode_named_tensors(entries[0], "serialized_named_tensors[0]")
        except TensorPayloadError as e:
            logger.warning("%s refused: %s", ROUTE, e)
            return web.json_response({"success": False, "message": f"{ROUTE}: {e}"}, status=400)
        t_decoded = time.perf_counter()
        names = [n for n, _ in named]
        problem = "no tensors" if not named else check_metadata(
            self.weights.state, names, [t.dtype for _, t in named], [tuple(t.shape) for _, t in named])
        if problem:
            logger.warning("%s refused: %s", ROUTE, problem)
            return web.json_response({"success": False, "message": f"{ROUTE}: {problem}"}, status=400)
        t_checked = time.perf_counter()
        await self.weights.load_between_steps(lambda: copy_into_model(self.weights.state, dict(named)), version)
        # Kept mapped until the next push: a trainer reuses one staging buffer, and mapping it
        # anew costs a page fault per 4 KiB, more than the copy itself (bench_colocated.py).
        self.mapped = named
        t1 = time.perf_counter()
        msg = (f"updated {len(names)} tensors in {t1 - t0:.3f}s (mapping {t_decoded - t0:.3f}s, "
               f"checks {t_checked - t_decoded:.3f}s, copy {t1 - t_checked:.3f}s)")
        logger.debug("%s: %s", ROUTE, msg)
        return web.json_response({"success": True, "message": msg})
