"""The embedded server's weight routes: load new weights (from disk, shared memory or a
process group), the weight-update session, reading weights back, the weight version.

Weight reads from disk and process-group receives run on worker threads; only the
final copy into the model runs on the model thread (``ModelRunner.call``), between
two decode steps. An update is checked in full before anything is copied, so a
refused one leaves the old weights serving.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Awaitable, Callable

import torch
from aiohttp import web

from .body import RequestError, check_fields, json_body, want
from .files import UnsafeFile, check_regular
from .limits import short
from .fp8_linear import sglang_fp8_problem, store
from .shm_alias import AliasedFiles, alias_problem, alias_weights, aliasable, own_weights
from .strict import NO_SESSION, OUTSIDE_SESSION, READBACK_FAILED, SESSION_OPEN, SGLangBehaviour
from .weights import (
    ShmWeightFile,
    WeightUpdateError,
    WeightUpdateGroup,
    check_full_checkpoint,
    check_metadata,
    check_shm_layout,
    copy_into_model,
    file_key,
    parse_dtype,
    parse_shape,
    read_hf_dir,
)

if TYPE_CHECKING:
    from .runner_contract import GenerationRunner

logger = logging.getLogger("arealite.server")

#: Group joins that may wait for their rendezvous at once; more are refused (429), so
#: that joins to an address that never answers cannot take every worker thread.
MAX_PENDING_JOINS = 4
MAX_WORLD_SIZE = 1 << 16
MAX_NAME_CHARS = 256


class WeightRoutes:
    """The weight-update handlers of one served model, and the state they keep (process
    groups joined, the mapped shared-memory file, the checkpoint last loaded from disk).

    ``state``: the model's tensors by name (``weights.model_state``); ``runner`` runs the
    copies into them between decode steps; ``timeout_s`` bounds group joins and receives."""

    def __init__(self, model: torch.nn.Module, state: dict[str, torch.Tensor], runner: GenerationRunner, *,
                 behaviour: SGLangBehaviour, device: torch.device, timeout_s: float, model_path: str):
        self.model = model
        self.device = device
        self.runner = runner
        self.state = state
        self.timeout_s = timeout_s
        #: The checkpoint the weights came from: the served one, then each disk update's.
        self.model_path = model_path
        self.groups: dict[str, WeightUpdateGroup] = {}
        self.group_locks: dict[str, asyncio.Lock] = {}
        # The trainer's shared-memory weight file, mapped once and kept while it stays the same.
        self.shm_files = AliasedFiles()
        self.shm_lock = asyncio.Lock()
        self.behaviour = behaviour
        self.session_open = False  # SGLang's weight-update session (see arealite.server.strict)
        self.architectures = list(getattr(model.config, "architectures", None) or [])
        # Strict mode: SGLang's scheduler runs weight operations one at a time, so a receive
        # blocked in a broken group holds up every later one (destroy, join, begin/end).
        self.scheduler = asyncio.Lock() if self.behaviour.strict else None
        # Receives block for up to weight_sync_timeout_s (joins get a thread each): they have
        # threads of their own, so that disk loads and the other routes never wait behind them.
        self._group_pool = ThreadPoolExecutor(4, thread_name_prefix="arealite-group")
        self._pending_joins = 0
        self.total_bytes = sum(t.numel() * t.element_size() for t in state.values())
        #: Whether the weights have no memory now; the server's memory routes set it.
        self.weights_released: Callable[[], bool] = lambda: False

    #: A weight version from a request body (None when absent), bounded.
    version_of = staticmethod(lambda body, route, key="weight_version": _version(body, route, key))

    def routes(self) -> dict[str, Callable[[web.Request], Awaitable[web.Response]]]:
        """POST path -> handler."""
        return {path: self.one_at_a_time(h) for path, h in self._handlers().items()}

    def one_at_a_time(self, handler: Callable[[web.Request], Awaitable[web.Response]]):
        """``handler``, run one at a time with every weight operation in strict mode (as
        SGLang's scheduler runs them)."""
        if self.scheduler is None:
            return handler
        lock = self.scheduler

        async def serialized(request: web.Request) -> web.Response:
            async with lock:
                return await handler(request)
        return serialized

    def _handlers(self) -> dict[str, Callable[[web.Request], Awaitable[web.Response]]]:
        return {
            "/update_weights_from_disk": self.update_weights_from_disk,
            "/update_weights_from_shm": self.update_weights_from_shm,
            "/init_weights_update_group": self.init_weights_update_group,
            "/update_weights_from_distributed": self.update_weights_from_distributed,
            "/destroy_weights_update_group": self.destroy_weights_update_group,
            "/get_weights_by_name": self.get_weights_by_name,
            "/update_weight_version": self.update_weight_version,
        } | ({"/begin_weight_update": self.begin_weight_update,
              "/end_weight_update": self.end_weight_update} if self.behaviour.has_sessions else {})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        route = "update_weights_from_disk"
        check_fields(body, {"model_path"}, {"weight_version", "load_format", "abort_all_requests", "flush_cache",
                                            "is_async", "token_step"}, route)
        self.check_flush(body, route)
        path = want(body, "model_path", str, route)
        version = _version(body, route)
        fmt = want(body, "load_format", str, route)
        if fmt not in (None, "auto", "safetensors"):
            raise RequestError(f"{route}: load_format {short(fmt)} is not supported (safetensors directories only)")
        if want(body, "abort_all_requests", bool, route, False):
            await self.runner.call(lambda: self.runner.abort(None, "aborted for a weight update"))
        t0 = time.perf_counter()
        try:
            tensors = await asyncio.to_thread(read_hf_dir, path)
            problem = check_full_checkpoint(self.state, tensors)
            if not problem and self.behaviour.strict:
                problem = sglang_fp8_problem(self.state, [(n, t.dtype) for n, t in tensors.items()])
        except (WeightUpdateError, OSError, ValueError) as e:
            problem = str(e)
        if problem:
            logger.warning("update_weights_from_disk(%s) refused: %s", path, problem)
            return web.json_response({"success": False, "message": problem, "num_paused_requests": 0}, status=400)

        await self.load_between_steps(lambda: copy_into_model(self.state, tensors), version)
        self.model_path = path
        msg = f"loaded {len(tensors)} tensors from {path} in {time.perf_counter() - t0:.2f}s"
        logger.info("update_weights_from_disk: %s (weight_version %s)", msg, self.runner.weight_version)
        return web.json_response({"success": True, "message": msg, "num_paused_requests": 0})

    async def update_weights_from_shm(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        route = "update_weights_from_shm"
        check_fields(body, {"path", "names", "dtypes", "shapes", "offsets"},
                     {"weight_version", "flush_cache", "abort_all_requests", "alias"}, route)
        self.check_flush(body, route)
        alias = want(body, "alias", bool, route, False)
        path = want(body, "path", str, route)
        names, dtypes_raw, shapes_raw, offsets = body["names"], body["dtypes"], body["shapes"], body["offsets"]
        if not all(isinstance(x, list) for x in (names, dtypes_raw, shapes_raw, offsets)):
            raise RequestError(f"{route}: names, dtypes, shapes and offsets must be lists")
        if not names or not len(names) == len(dtypes_raw) == len(shapes_raw) == len(offsets):
            raise RequestError(f"{route}: names, dtypes, shapes and offsets must be non-empty lists of equal "
                               f"length (got {len(names)}, {len(dtypes_raw)}, {len(shapes_raw)}, {len(offsets)})")
        if not all(isinstance(n, str) for n in names):
            raise RequestError(f"{route}: names must be strings")
        for i, off in enumerate(offsets):
            if not isinstance(off, int) or isinstance(off, bool) or off < 0:
                raise RequestError(f"{route}: offsets[{i}] must be a non-negative int (a byte offset), got {short(off)}")
        try:
            dtypes = [parse_dtype(d, f"dtypes[{i}]") for i, d in enumerate(dtypes_raw)]
            shapes = [parse_shape(s, f"shapes[{i}]") for i, s in enumerate(shapes_raw)]
        except WeightUpdateError as e:
            raise RequestError(f"{route}: {e}") from e
        version = _version(body, route)
        if want(body, "abort_all_requests", bool, route, False):
            await self.runner.call(lambda: self.runner.abort(None, "aborted for a weight update"))

        t0 = time.perf_counter()
        async with self.shm_lock:
            try:
                shm = await asyncio.to_thread(self._map_shm, path)
                problem = check_shm_layout(self.state, names, dtypes, shapes, offsets, shm.size)
                if alias and not problem:
                    problem = alias_problem(self.device)
                    if not problem and not aliasable(self.model, names):
                        alias = False  # slices of fused parameters: copied (docs/moe.md)
                        logger.info("%s(%s): the tensors are not all whole parameters; copying instead of "
                                    "serving from the file", route, path)
            except WeightUpdateError as e:
                problem = str(e)
            if problem:
                # Checked in full before any copy: a refused update leaves the old weights serving.
                logger.warning("%s(%s) refused: %s", route, path, problem)
                return web.json_response({"success": False, "message": f"{route}: {problem}"}, status=400)

            def copy() -> None:
                with torch.no_grad():
                    for name, dt, shape, off in zip(names, dtypes, shapes, offsets):
                        store(self.state, name, shm.tensor(off, dt, shape))

            def swap() -> None:
                alias_weights(self.model, self.state, shm, names, dtypes, shapes, offsets)
                self.shm_files.serving = shm.key

            await self.load_between_steps(swap if alias else copy, version, copies=not alias)
        msg = f"updated {len(names)} tensors from {path} in {time.perf_counter() - t0:.3f}s"
        logger.debug("%s: %s", route, msg)
        return web.json_response({"success": True, "message": msg})

    def check_flush(self, body: dict, route: str) -> None:
        """SGLang flushes its cache after every load unless told ``flush_cache: false``; paused
        ``in_place`` with requests frozen in the batch the flush fails and the scheduler's assertion
        (``flush_cache_after_weight_update``) takes the server down. Refused here, before loading."""
        flush = want(body, "flush_cache", bool, route, True)
        running = self.runner.n_running
        if flush and self.runner.pause.holds_old_kv and running:
            raise RequestError(
                f"{route}: flush_cache is true (the default) while generation is paused in_place with "
                f"{running} requests in the batch: SGLang cannot flush then and its scheduler dies on the "
                "failed flush; send flush_cache: false (weight_sync.pause_mode in_place does)")

    async def load_between_steps(self, copy: Callable[[], None], version: str | None, copies: bool = True) -> None:
        """Run `copy` (new tensors into the model) on the runner's thread, between two
        decode steps, and take on `version` with it (None keeps the current one). A copy into
        parameters that point into a mapped file gives them their own storage first. Refused
        while the weights are released (`arealite.server.memory_routes`)."""
        if self.weights_released():
            raise RequestError("the weights are released (release_memory_occupation); "
                               "call resume_memory_occupation(tags=['weights']) before updating them")

        def load() -> None:
            if copies and self.shm_files.serving is not None:
                own_weights(self.model, self.state)
                self.shm_files.serving = None
            copy()
            if version is not None:
                self.runner.weight_version = str(version)

        await self.runner.call(load)

    def own_weights(self) -> None:
        """Give every parameter a storage of its own (on the model thread): copies those that
        point into a mapped file (a served shared-memory file or the loaded checkpoint)."""
        own_weights(self.model, self.state)
        self.shm_files.serving = None

    def _map_shm(self, path: str) -> ShmWeightFile:
        """The mapping of `path`, reusing the cached one while it is the same file."""
        try:  # a FIFO or device is refused here, before anything opens it under the lock
            key = file_key(path, check_regular(path, "path"))
        except UnsafeFile as e:
            raise WeightUpdateError(str(e)) from None
        return self.shm_files.get(key, path)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        route = "init_weights_update_group"
        fields = {"master_address", "master_port", "rank_offset", "world_size", "group_name"}
        check_fields(body, fields, {"backend"}, route)
        addr = want(body, "master_address", str, route)
        port = want(body, "master_port", int, route)
        rank = want(body, "rank_offset", int, route)
        world = want(body, "world_size", int, route)
        name = want(body, "group_name", str, route)
        backend = want(body, "backend", str, route, "nccl" if self.device.type == "cuda" else "gloo")
        if backend not in ("gloo", "nccl"):
            raise RequestError(f"{route}: backend {short(backend)} is not supported (gloo or nccl)")
        if backend == "nccl" and self.device.type != "cuda":
            raise RequestError(f"{route}: backend 'nccl' needs a CUDA device; this server runs on {self.device}")
        _check_group_fields(route, addr, port, rank, world, name)
        if name in self.groups:
            return web.json_response({"success": False, "message": f"group {short(name)} already exists"}, status=400)
        if self._pending_joins >= MAX_PENDING_JOINS:
            return web.json_response({"success": False, "message": (
                f"{MAX_PENDING_JOINS} group joins are already waiting for their rendezvous; retry later")},
                status=429)
        self._pending_joins += 1
        timeout = self.timeout_s
        try:
            group = await _join_in_thread(lambda: WeightUpdateGroup(
                master_address=addr, master_port=port, rank=rank, world_size=world, group_name=name,
                backend=backend, timeout_s=timeout, device=self.device), timeout + 1.0)
        except asyncio.TimeoutError:
            # A master that accepts the connection and never answers holds TCPStore past its own
            # timeout; the thread is left behind (and its late group destroyed), the route answers.
            logger.warning("init_weights_update_group %s: no rendezvous within %gs", short(name), timeout)
            return web.json_response({"success": False, "message": f"joining group {short(name)} failed: no "
                                      f"rendezvous with {short(addr)}:{port} within {timeout:g}s"}, status=400)
        except (RuntimeError, ValueError, OSError, TypeError) as e:  # rendezvous failed or timed out
            logger.warning("init_weights_update_group %s failed: %s", short(name), e)
            return web.json_response({"success": False, "message": f"joining group {short(name)} failed: "
                                                                   f"{short(str(e), 300)}"}, status=400)
        finally:
            self._pending_joins -= 1
        self.groups[name] = group
        self.group_locks[name] = asyncio.Lock()
        logger.info("joined weight-update group %r as rank %d of %d (%s)", name, rank, world, backend)
        return web.json_response({"success": True, "message": f"joined group {name!r} as rank {rank}"})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        route = "update_weights_from_distributed"
        check_fields(body, {"names", "dtypes", "shapes"},
                     {"group_name", "flush_cache", "weight_version", "flattened_bucket", "abort_all_requests",
                      "load_format"}, route)
        self.check_flush(body, route)
        names, dtypes_raw, shapes_raw = body["names"], body["dtypes"], body["shapes"]
        if not (isinstance(names, list) and isinstance(dtypes_raw, list) and isinstance(shapes_raw, list)):
            raise RequestError(f"{route}: names, dtypes and shapes must be lists")
        if not names or not len(names) == len(dtypes_raw) == len(shapes_raw):
            raise RequestError(f"{route}: names, dtypes and shapes must be non-empty lists of equal length "
                               f"(got {len(names)}, {len(dtypes_raw)}, {len(shapes_raw)})")
        if not all(isinstance(n, str) for n in names):
            raise RequestError(f"{route}: names must be strings")
        try:
            dtypes = [parse_dtype(d, f"dtypes[{i}]") for i, d in enumerate(dtypes_raw)]
            shapes = [parse_shape(s, f"shapes[{i}]") for i, s in enumerate(shapes_raw)]
        except WeightUpdateError as e:
            # Without a dtype and shape the broadcasts cannot even be received.
            raise RequestError(f"{route}: {e}") from e
        n_bytes = sum(_nbytes(dt, sh) for dt, sh in zip(dtypes, shapes))
        if n_bytes > 2 * self.total_bytes + (1 << 20):
            # Scratch buffers this size would exhaust memory; the sender's broadcast then times out.
            raise RequestError(f"{route}: the shapes add up to {n_bytes} bytes, far more than this model's "
                               f"{self.total_bytes}; refused without receiving")
        name = want(body, "group_name", str, route, next(iter(self.groups), None))
        if name not in self.groups:
            raise RequestError(f"{route}: no weight-update group {short(name)}; call init_weights_update_group first "
                               f"(groups: {sorted(self.groups)})")
        if self.behaviour.has_sessions and not self.session_open:
            # SGLang refuses before receiving: the trainer's broadcast then has no receiver.
            logger.warning("%s refused: %s", route, OUTSIDE_SESSION)
            return web.json_response({"success": False, "message": OUTSIDE_SESSION}, status=400)
        # SGLang names the flat layout load_format="flattened_bucket"; a
        # boolean flattened_bucket field is accepted as well.
        fmt = want(body, "load_format", str, route)
        if fmt not in (None, "auto", "flattened_bucket"):
            raise RequestError(f"{route}: load_format {short(fmt)} is not supported (None, 'auto' or 'flattened_bucket')")
        flattened = want(body, "flattened_bucket", bool, route, False) or fmt == "flattened_bucket"
        version = _version(body, route)
        if want(body, "abort_all_requests", bool, route, False):
            await self.runner.call(lambda: self.runner.abort(None, "aborted for a weight update"))

        problem = check_metadata(self.state, names, dtypes, shapes)
        if not problem and self.behaviour.strict:
            problem = sglang_fp8_problem(self.state, list(zip(names, dtypes)))

        if flattened and len(set(dtypes)) > 1:
            problem = (f"flattened_bucket needs one dtype for all tensors, got {sorted(map(str, set(dtypes)))}; "
                       f"receiving a flat {dtypes[0]} buffer and discarding it")
        group = self.groups[name]
        t0 = time.perf_counter()
        buf = group.buffers.take(dtypes, shapes)
        async with self.group_locks[name]:
            try:
                # Received even when the metadata is wrong: rank 0 broadcasts
                # regardless, and an unmatched broadcast would hang the group.
                tensors = await asyncio.get_running_loop().run_in_executor(
                    self._group_pool, group.receive, dtypes, shapes, flattened, buf)
            except (RuntimeError, ValueError) as e:
                logger.warning("%s: receiving from group %r failed: %s", route, name, e)
                return web.json_response({"success": False, "message": f"receiving failed: {e}"}, status=400)
        if problem:
            logger.warning("%s refused: %s", route, problem)
            return web.json_response({"success": False, "message": problem}, status=400)

        await self.load_between_steps(lambda: copy_into_model(self.state, dict(zip(names, tensors))), version)
        # Kept for the next bucket only after a load: a refused bucket's buffer (of unchecked
        # sizes) and one a failed or cancelled receive or copy may still hold are dropped.
        group.buffers.give_back(buf)
        msg = f"updated {len(names)} tensors in {time.perf_counter() - t0:.3f}s"
        logger.debug("%s: %s", route, msg)
        return web.json_response({"success": True, "message": msg})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await json_body(request, allow_empty=True)
        route = "destroy_weights_update_group"
        check_fields(body, set(), {"group_name"}, route)
        name = want(body, "group_name", str, route, next(iter(self.groups), None))
        group = self.groups.pop(name, None)
        if group is None:
            return web.json_response({"success": False, "message": f"no weight-update group {short(name)}"}, status=400)
        self.group_locks.pop(name, None)
        await asyncio.to_thread(group.destroy)
        return web.json_response({"success": True, "message": f"destroyed group {name!r}"})

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        body = await json_body(request, allow_empty=True)
        # SGLang's request structs ignore keys they do not declare.
        selector = want(body, "selector", str, "begin_weight_update", "all")
        if selector not in ("target", "draft", "all"):
            raise RequestError(f"begin_weight_update: selector {short(selector)} is not 'target', 'draft' or 'all'")
        if self.session_open:
            return web.json_response({"success": False, "message": SESSION_OPEN}, status=400)
        self.session_open = True
        await self.runner.call(lambda: setattr(self.runner.pause, "in_update_bracket", True))
        return web.json_response({"success": True, "message": "Success"})

    async def end_weight_update(self, request: web.Request) -> web.Response:
        await json_body(request, allow_empty=True)
        if not self.session_open:
            return web.json_response({"success": False, "message": NO_SESSION}, status=400)
        self.session_open = False
        await self.runner.call(lambda: setattr(self.runner.pause, "in_update_bracket", False))
        return web.json_response({"success": True, "message": "Success"})

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        route = "get_weights_by_name"
        check_fields(body, {"name"}, {"truncate_size"}, route)
        name = want(body, "name", str, route)
        n = want(body, "truncate_size", int, route, 100)
        if n < 1:
            raise RequestError(f"{route}: truncate_size must be >= 1, got {n}")
        if not self.behaviour.can_read_back(self.architectures):
            # SGLang: the model class has no get_weights_by_name (e.g. Qwen2), whatever the name.
            return web.json_response({"error": {"message": READBACK_FAILED}}, status=400)
        if name not in self.state:
            raise RequestError(f"{route}: {short(name)} is not a weight of this model")
        # As SGLang: the first `n` rows (of a 1-D tensor, the first `n` values), as nested lists.
        t = torch.atleast_1d(self.state[name].detach())
        values = await self.runner.call(lambda: t[:n].float().cpu().tolist())
        return web.json_response(values)

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        route = "update_weight_version"
        check_fields(body, {"new_version"}, {"abort_all_requests"}, route)
        version = _version(body, route, "new_version")
        if version is None:
            raise RequestError(f"{route}: new_version must be a string or an int, got null")
        abort_all = want(body, "abort_all_requests", bool, route, False)

        def apply() -> None:
            if abort_all:
                self.runner.abort(None, "aborted by update_weight_version")
            self.runner.weight_version = version

        await self.runner.call(apply)
        return web.json_response({"success": True, "message": f"weight_version is now {version}"})

    def close(self) -> None:
        """Leave every process group and unmap the shared-memory file."""
        for g in self.groups.values():
            g.destroy()
        self.groups.clear()
        self.shm_files.close()
        self._group_pool.shutdown(wait=False, cancel_futures=True)


def _version(body: dict, route: str, key: str = "weight_version") -> str | None:
    """A weight version from the body (None when absent), bounded: it is echoed in every answer."""
    v = want(body, key, (str, int), route)
    if v is None:
        return None
    text = str(v)
    if len(text) > MAX_NAME_CHARS or not text.isprintable():
        raise RequestError(f"{route}: {key} {short(v)} must be at most {MAX_NAME_CHARS} printable characters")
    return text


def _check_group_fields(route: str, addr: str, port: int, rank: int, world: int, name: str) -> None:
    """Range checks of a group join's numbers and names (before any connection is tried)."""
    if not 1 <= port <= 65535:
        raise RequestError(f"{route}: master_port {short(port)} is not a TCP port (1..65535)")
    if not 2 <= world <= MAX_WORLD_SIZE:
        raise RequestError(f"{route}: world_size {short(world)} must be in [2, {MAX_WORLD_SIZE}] "
                           "(the trainer plus at least one server)")
    if not 1 <= rank < world:
        raise RequestError(f"{route}: rank_offset {short(rank)} must be in [1, world_size={world}) "
                           "(rank 0 is the trainer)")
    for field, value in (("master_address", addr), ("group_name", name)):
        if not value or len(value) > MAX_NAME_CHARS or not value.isprintable() or value != value.strip():
            raise RequestError(f"{route}: {field} {short(value)} must be 1..{MAX_NAME_CHARS} printable "
                               "characters without surrounding spaces")


async def _join_in_thread(join: Callable[[], WeightUpdateGroup], timeout: float) -> WeightUpdateGroup:
    """``join()`` on a thread of its own, awaited at most ``timeout`` seconds.

    Not a pool's thread: a join that never returns would hold that worker forever.
    A group that arrives after the caller gave up is destroyed.
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def deliver(group: WeightUpdateGroup | None, error: BaseException | None) -> None:
        if fut.done():
            if group is not None:
                group.destroy()
        elif error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(group)

    def run() -> None:
        try:
            group, error = join(), None
        except Exception as e:
            group, error = None, e
        try:
            loop.call_soon_threadsafe(deliver, group, error)
        except RuntimeError:  # the loop is closed: the server is shutting down
            if group is not None:
                group.destroy()

    threading.Thread(target=run, name="arealite-group-join", daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.shield(fut), timeout)
    except asyncio.TimeoutError:
        fut.cancel()  # marks it done: a late group is destroyed by `deliver`
        raise


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n
