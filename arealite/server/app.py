"""The HTTP side of the embedded server: SGLang's routes and JSON shapes on aiohttp.

Handlers validate at the boundary (a bad request is a 400 whose message names
the field), then hand work to the ``ModelRunner`` thread and await it. Weight
reads from disk and process-group receives run on worker threads, and only the
final copy into the model runs on the model thread, between two decode steps.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from .args import ServerArgs
from .runner import ModelRunner, Sequence
from .sampling import RequestError, parse_generate
from .weights import (
    ShmWeightFile,
    WeightUpdateError,
    WeightUpdateGroup,
    check_full_checkpoint,
    check_metadata,
    check_shm_layout,
    file_key,
    copy_into_model,
    model_state,
    parse_dtype,
    parse_shape,
    read_hf_dir,
)

logger = logging.getLogger("arealite.server")

SGLANG_VERSION = "0.5.23"
ENGINE_NAME = "arealite-embedded"

_STATE_KEY = web.AppKey("arealite_server", object)


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def _check_fields(body: dict, required: set[str], optional: set[str], route: str) -> None:
    missing = sorted(required - set(body))
    if missing:
        raise RequestError(f"{route}: missing field(s) {missing}")
    unknown = sorted(set(body) - required - optional)
    if unknown:
        raise RequestError(f"{route}: unknown field(s) {unknown}; known: {sorted(required | optional)}")


def _want(body: dict, key: str, types: type | tuple[type, ...], route: str, default: Any = None) -> Any:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,))):
        raise RequestError(f"{route}: field {key!r} has the wrong type ({type(v).__name__}: {v!r})")
    return v


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    return torch.device(name)


def load_model(args: ServerArgs):
    """Load the HF model (and tokenizer unless skipped); return (model, tokenizer, device)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    device = resolve_device(args.device)
    if args.dtype == "auto":
        cfg = AutoConfig.from_pretrained(args.model_path)
        dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = parse_dtype(dtype)
    else:
        dtype = parse_dtype(args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype).to(device).eval()
    model.requires_grad_(False)
    tokenizer = None if args.skip_tokenizer_init else AutoTokenizer.from_pretrained(args.model_path)
    return model, tokenizer, device


class EmbeddedServer:
    """The state behind the routes: model, tokenizer, runner, weight-update groups."""

    def __init__(self, args: ServerArgs, model: torch.nn.Module, tokenizer, device: torch.device):
        self.args = args
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.model_path = str(args.model_path)
        cfg = model.config
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.context_length = int(args.context_length or getattr(cfg, "max_position_embeddings", 4096))
        self.state = model_state(model)
        self.groups: dict[str, WeightUpdateGroup] = {}
        self.group_locks: dict[str, asyncio.Lock] = {}
        # The trainer's shared-memory weight file, mapped once and kept while it stays the same.
        self.shm: ShmWeightFile | None = None
        self.shm_lock = asyncio.Lock()
        self.started = time.time()

        eos: set[int] = set()
        for src in (cfg.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                    getattr(tokenizer, "eos_token_id", None)):
            if isinstance(src, int):
                eos.add(src)
            elif isinstance(src, (list, tuple)):
                eos.update(int(t) for t in src)
        pad = cfg.pad_token_id if isinstance(cfg.pad_token_id, int) else getattr(tokenizer, "pad_token_id", None)
        self.runner = ModelRunner(
            model, device=device, eos_ids=eos, pad_id=int(pad if pad is not None else 0),
            vocab_size=self.vocab_size, max_batch_size=args.max_batch_size,
            random_seed=args.random_seed, weight_version=str(args.weight_version),
        )

    # -- helpers ----------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def format_output(self, seq: Sequence) -> dict[str, Any]:
        sp = seq.inp.sampling
        meta: dict[str, Any] = {
            "id": seq.inp.rid,
            "finish_reason": seq.finish_reason,
            "prompt_tokens": len(seq.inp.input_ids),
            "completion_tokens": len(seq.output_ids),
            "cached_tokens": 0,
            "weight_version": seq.weight_version,
            "e2e_latency": seq.end_time - seq.start_time,
        }
        if seq.inp.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(seq.output_logprobs, seq.output_ids)]
        out: dict[str, Any] = {}
        if self.tokenizer is not None:
            ids = seq.output_ids
            fr = seq.finish_reason or {}
            if fr.get("type") == "stop" and not sp.no_stop_trim and ids:
                ids = ids[:-1]  # SGLang trims the matched stop token from the text
            out["text"] = self.tokenizer.decode(
                ids, skip_special_tokens=sp.skip_special_tokens,
                spaces_between_special_tokens=sp.spaces_between_special_tokens,
            )
        out["output_ids"] = list(seq.output_ids)
        out["meta_info"] = meta
        return out

    # -- routes -----------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        r = self.runner
        if r.paused or r.in_update_bracket:
            # Generation is intentionally held; the server itself is fine.
            return web.json_response({"status": "paused"})
        from .sampling import GenerateInput, SamplingConfig

        inp = GenerateInput(rid=f"health-{time.monotonic_ns()}", input_ids=[0],
                            sampling=SamplingConfig(max_new_tokens=1, temperature=0.0))
        try:
            await asyncio.wait_for(r.generate(inp), timeout=30)
        except (asyncio.TimeoutError, RuntimeError) as e:
            return _error(f"health generation failed: {e!r}", status=503)
        return web.json_response({"status": "ok"})

    async def get_model_info(self, request: web.Request) -> web.Response:
        cfg = self.model.config
        return web.json_response({
            "model_path": self.model_path,
            "tokenizer_path": None if self.tokenizer is None else str(self.args.model_path),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.runner.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(cfg, "model_type", None),
            "architectures": getattr(cfg, "architectures", None),
        })

    async def get_server_info(self, request: web.Request) -> web.Response:
        a, r = self.args, self.runner
        return web.json_response({
            "version": SGLANG_VERSION,
            "engine": ENGINE_NAME,
            "model_path": self.model_path,
            "tokenizer_path": None if self.tokenizer is None else str(a.model_path),
            "served_model_name": str(a.model_path),
            "weight_version": r.weight_version,
            "host": a.host,
            "port": a.port,
            "dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
            "device": str(self.device),
            "random_seed": a.random_seed,
            "max_running_requests": a.max_batch_size,
            "context_length": self.context_length,
            "vocab_size": self.vocab_size,
            "skip_tokenizer_init": self.tokenizer is None,
            "tp_size": 1,
            "dp_size": 1,
            "uptime_s": time.time() - self.started,
            "internal_states": [{
                "num_running_reqs": r.n_running, "num_waiting_reqs": r.n_waiting,
                "paused": r.paused, "in_weight_update": r.in_update_bracket, **r.stats,
                # CPU seconds of the whole server process: lets benchmarks on a
                # busy machine compare work done rather than contended wall time.
                "cpu_time_s": time.process_time(),
            }],
        })

    async def generate(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        inputs, batch = parse_generate(
            body, vocab_size=self.vocab_size, context_length=self.context_length,
            encode=self.encode if self.tokenizer is not None else None,
        )
        seqs = await asyncio.gather(*(self.runner.generate(i) for i in inputs))
        outs = [self.format_output(s) for s in seqs]
        return web.json_response(outs if batch else outs[0])

    async def flush_cache(self, request: web.Request) -> web.Response:
        # There is no prefix cache to flush; say so rather than pretend.
        return web.json_response({"success": True, "message": "no prefix cache: nothing to flush"})

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await _json_body(request, allow_empty=True)
        _check_fields(body, set(), {"mode"}, "pause_generation")
        mode = _want(body, "mode", str, "pause_generation", "abort")
        if mode not in ("abort", "in_place"):
            raise RequestError(f"pause_generation: mode {mode!r} is not supported (use 'abort' or 'in_place')")
        n = await self.runner.call(lambda: self.runner.set_paused(True, mode))
        return web.json_response({"success": True, "message": f"generation paused ({mode}); {n} running requests affected"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        body = await _json_body(request, allow_empty=True)
        _check_fields(body, set(), set(), "continue_generation")
        await self.runner.call(lambda: self.runner.set_paused(False))
        return web.json_response({"success": True, "message": "generation continued"})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        _check_fields(body, set(), {"rid", "abort_all", "abort_message"}, "abort_request")
        rid = _want(body, "rid", str, "abort_request")
        abort_all = _want(body, "abort_all", bool, "abort_request", False)
        if not abort_all and not rid:
            raise RequestError("abort_request: give a non-empty 'rid' (prefix) or 'abort_all': true")
        msg = _want(body, "abort_message", str, "abort_request", "aborted by abort_request")
        n = await self.runner.call(lambda: self.runner.abort(None if abort_all else rid, msg))
        return web.json_response({"success": True, "num_aborted": n})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        route = "update_weights_from_disk"
        _check_fields(body, {"model_path"}, {"weight_version", "load_format", "abort_all_requests", "flush_cache",
                                             "is_async", "token_step"}, route)
        path = _want(body, "model_path", str, route)
        version = _want(body, "weight_version", (str, int), route)
        fmt = _want(body, "load_format", str, route)
        if fmt not in (None, "auto", "safetensors"):
            raise RequestError(f"{route}: load_format {fmt!r} is not supported (safetensors directories only)")
        if _want(body, "abort_all_requests", bool, route, False):
            await self.runner.call(lambda: self.runner.abort(None, "aborted for a weight update"))
        t0 = time.perf_counter()
        try:
            tensors = await asyncio.to_thread(read_hf_dir, path)
            problem = check_full_checkpoint(self.state, tensors)
        except (WeightUpdateError, OSError, ValueError) as e:
            problem = str(e)
        if problem:
            logger.warning("update_weights_from_disk(%s) refused: %s", path, problem)
            return web.json_response({"success": False, "message": problem, "num_paused_requests": 0}, status=400)

        def load() -> None:
            copy_into_model(self.state, tensors)
            if version is not None:
                self.runner.weight_version = str(version)

        await self.runner.call(load)
        self.model_path = path
        msg = f"loaded {len(tensors)} tensors from {path} in {time.perf_counter() - t0:.2f}s"
        logger.info("update_weights_from_disk: %s (weight_version %s)", msg, self.runner.weight_version)
        return web.json_response({"success": True, "message": msg, "num_paused_requests": 0})

    async def update_weights_from_shm(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        route = "update_weights_from_shm"
        _check_fields(body, {"path", "names", "dtypes", "shapes", "offsets"},
                      {"weight_version", "flush_cache", "abort_all_requests"}, route)
        path = _want(body, "path", str, route)
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
                raise RequestError(f"{route}: offsets[{i}] must be a non-negative int (a byte offset), got {off!r}")
        try:
            dtypes = [parse_dtype(d, f"dtypes[{i}]") for i, d in enumerate(dtypes_raw)]
            shapes = [parse_shape(s, f"shapes[{i}]") for i, s in enumerate(shapes_raw)]
        except WeightUpdateError as e:
            raise RequestError(f"{route}: {e}") from e
        version = _want(body, "weight_version", (str, int), route)
        if _want(body, "abort_all_requests", bool, route, False):
            await self.runner.call(lambda: self.runner.abort(None, "aborted for a weight update"))

        t0 = time.perf_counter()
        async with self.shm_lock:
            try:
                shm = await asyncio.to_thread(self._map_shm, path)
                problem = check_shm_layout(self.state, names, dtypes, shapes, offsets, shm.size)
            except WeightUpdateError as e:
                problem = str(e)
            if problem:
                # Checked in full before any copy: a refused update leaves the old weights serving.
                logger.warning("%s(%s) refused: %s", route, path, problem)
                return web.json_response({"success": False, "message": f"{route}: {problem}"}, status=400)

            def load() -> None:
                with torch.no_grad():
                    for name, dt, shape, off in zip(names, dtypes, shapes, offsets):
                        self.state[name].copy_(shm.tensor(off, dt, shape))
                if version is not None:
                    self.runner.weight_version = str(version)

            await self.runner.call(load)
        msg = f"updated {len(names)} tensors from {path} in {time.perf_counter() - t0:.3f}s"
        logger.debug("%s: %s", route, msg)
        return web.json_response({"success": True, "message": msg})

    def _map_shm(self, path: str) -> ShmWeightFile:
        """The mapping of `path`, reusing the cached one while it is the same file."""
        try:
            key = file_key(path, os.stat(path))
        except OSError as e:
            raise WeightUpdateError(f"path {path!r} cannot be opened: {e.strerror}") from None
        if self.shm is not None and self.shm.key == key:
            return self.shm
        if self.shm is not None:
            self.shm.close()  # another file now: release the old one's memory
            self.shm = None
        self.shm = ShmWeightFile(path)
        return self.shm

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        route = "init_weights_update_group"
        fields = {"master_address", "master_port", "rank_offset", "world_size", "group_name"}
        _check_fields(body, fields, {"backend"}, route)
        addr = _want(body, "master_address", str, route)
        port = _want(body, "master_port", int, route)
        rank = _want(body, "rank_offset", int, route)
        world = _want(body, "world_size", int, route)
        name = _want(body, "group_name", str, route)
        backend = _want(body, "backend", str, route, "nccl" if self.device.type == "cuda" else "gloo")
        if backend not in ("gloo", "nccl"):
            raise RequestError(f"{route}: backend {backend!r} is not supported (gloo or nccl)")
        if backend == "nccl" and self.device.type != "cuda":
            raise RequestError(f"{route}: backend 'nccl' needs a CUDA device; this server runs on {self.device}")
        if not 1 <= rank < world:
            raise RequestError(f"{route}: rank_offset {rank} must be in [1, world_size={world}) (rank 0 is the trainer)")
        if name in self.groups:
            return web.json_response({"success": False, "message": f"group {name!r} already exists"}, status=400)
        try:
            group = await asyncio.to_thread(
                lambda: WeightUpdateGroup(master_address=addr, master_port=port, rank=rank, world_size=world,
                                          group_name=name, backend=backend,
                                          timeout_s=self.args.weight_sync_timeout_s, device=self.device))
        except (RuntimeError, ValueError, OSError) as e:  # rendezvous failed or timed out
            logger.warning("init_weights_update_group %r failed: %s", name, e)
            return web.json_response({"success": False, "message": f"joining group {name!r} failed: {e}"}, status=400)
        self.groups[name] = group
        self.group_locks[name] = asyncio.Lock()
        logger.info("joined weight-update group %r as rank %d of %d (%s)", name, rank, world, backend)
        return web.json_response({"success": True, "message": f"joined group {name!r} as rank {rank}"})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        route = "update_weights_from_distributed"
        _check_fields(body, {"names", "dtypes", "shapes"},
                      {"group_name", "flush_cache", "weight_version", "flattened_bucket", "abort_all_requests",
                       "load_format"}, route)
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
        name = _want(body, "group_name", str, route, next(iter(self.groups), None))
        if name not in self.groups:
            raise RequestError(f"{route}: no weight-update group {name!r}; call init_weights_update_group first "
                               f"(groups: {sorted(self.groups)})")
        # SGLang names the flat layout load_format="flattened_bucket"; a
        # boolean flattened_bucket field is accepted as well.
        fmt = _want(body, "load_format", str, route)
        if fmt not in (None, "auto", "flattened_bucket"):
            raise RequestError(f"{route}: load_format {fmt!r} is not supported (None, 'auto' or 'flattened_bucket')")
        flattened = _want(body, "flattened_bucket", bool, route, False) or fmt == "flattened_bucket"
        version = _want(body, "weight_version", (str, int), route)
        if _want(body, "abort_all_requests", bool, route, False):
            await self.runner.call(lambda: self.runner.abort(None, "aborted for a weight update"))

        problem = check_metadata(self.state, names, dtypes, shapes)
        if flattened and len(set(dtypes)) > 1:
            problem = (f"flattened_bucket needs one dtype for all tensors, got {sorted(map(str, set(dtypes)))}; "
                       f"receiving a flat {dtypes[0]} buffer and discarding it")
        group = self.groups[name]
        t0 = time.perf_counter()
        async with self.group_locks[name]:
            try:
                # Received even when the metadata is wrong: rank 0 broadcasts
                # regardless, and an unmatched broadcast would hang the group.
                tensors = await asyncio.to_thread(group.receive, dtypes, shapes, flattened)
            except (RuntimeError, ValueError) as e:
                logger.warning("%s: receiving from group %r failed: %s", route, name, e)
                return web.json_response({"success": False, "message": f"receiving failed: {e}"}, status=400)
        if problem:
            logger.warning("%s refused: %s", route, problem)
            return web.json_response({"success": False, "message": problem}, status=400)

        def load() -> None:
            copy_into_model(self.state, dict(zip(names, tensors)))
            if version is not None:
                self.runner.weight_version = str(version)

        await self.runner.call(load)
        msg = f"updated {len(names)} tensors in {time.perf_counter() - t0:.3f}s"
        logger.debug("%s: %s", route, msg)
        return web.json_response({"success": True, "message": msg})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await _json_body(request, allow_empty=True)
        route = "destroy_weights_update_group"
        _check_fields(body, set(), {"group_name"}, route)
        name = _want(body, "group_name", str, route, next(iter(self.groups), None))
        group = self.groups.pop(name, None)
        if group is None:
            return web.json_response({"success": False, "message": f"no weight-update group {name!r}"}, status=400)
        self.group_locks.pop(name, None)
        await asyncio.to_thread(group.destroy)
        return web.json_response({"success": True, "message": f"destroyed group {name!r}"})

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        await _json_body(request, allow_empty=True)  # options SGLang may send are not needed here
        await self.runner.call(lambda: setattr(self.runner, "in_update_bracket", True))
        return web.json_response({"success": True, "message": "admission paused for a weight update"})

    async def end_weight_update(self, request: web.Request) -> web.Response:
        await _json_body(request, allow_empty=True)
        await self.runner.call(lambda: setattr(self.runner, "in_update_bracket", False))
        return web.json_response({"success": True, "message": "weight update finished"})

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        route = "get_weights_by_name"
        _check_fields(body, {"name"}, {"truncate_size"}, route)
        name = _want(body, "name", str, route)
        n = _want(body, "truncate_size", int, route, 100)
        if n < 1:
            raise RequestError(f"{route}: truncate_size must be >= 1, got {n}")
        if name not in self.state:
            raise RequestError(f"{route}: {name!r} is not a weight of this model")
        # As SGLang: the first `n` rows (of a 1-D tensor, the first `n` values), as nested lists.
        t = torch.atleast_1d(self.state[name].detach())
        values = await self.runner.call(lambda: t[:n].float().cpu().tolist())
        return web.json_response(values)

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        route = "update_weight_version"
        _check_fields(body, {"new_version"}, {"abort_all_requests"}, route)
        version = str(_want(body, "new_version", (str, int), route))
        abort_all = _want(body, "abort_all_requests", bool, route, False)

        def apply() -> None:
            if abort_all:
                self.runner.abort(None, "aborted by update_weight_version")
            self.runner.weight_version = version

        await self.runner.call(apply)
        return web.json_response({"success": True, "message": f"weight_version is now {version}"})

    async def close(self) -> None:
        await asyncio.to_thread(self.runner.shutdown)
        for g in self.groups.values():
            g.destroy()
        self.groups.clear()
        if self.shm is not None:
            self.shm.close()
            self.shm = None


async def _json_body(request: web.Request, allow_empty: bool = False) -> dict:
    raw = await request.read()
    if not raw.strip():
        if allow_empty:
            return {}
        raise RequestError("the request body is empty; send a JSON object")
    import json

    try:
        body = json.loads(raw)
    except ValueError as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _make_middleware(api_key: str | None):
    expected = f"Bearer {api_key}".encode() if api_key else None

    @web.middleware
    async def middleware(request: web.Request, handler):
        # As SGLang: the health probes (every path starting with /health) need no key.
        if expected is not None and not request.path.startswith("/health"):
            got = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(got, expected):
                return _error("unauthorized: send 'Authorization: Bearer <api key>'", status=401)
        try:
            return await handler(request)
        except RequestError as e:
            return _error(str(e), status=400)

    return middleware


def build_app(server: EmbeddedServer) -> web.Application:
    """The aiohttp application serving ``server``'s routes."""
    app = web.Application(middlewares=[_make_middleware(server.args.api_key)], client_max_size=1 << 30)
    app[_STATE_KEY] = server
    s = server
    both = ("/health", "/health_generate", "/get_model_info", "/get_server_info", "/flush_cache")
    for path, h in zip(both, (s.health, s.health_generate, s.get_model_info, s.get_server_info, s.flush_cache)):
        app.router.add_get(path, h)
        app.router.add_post(path, h)
    for path, h in {
        "/generate": s.generate,
        "/pause_generation": s.pause_generation,
        "/continue_generation": s.continue_generation,
        "/abort_request": s.abort_request,
        "/update_weights_from_disk": s.update_weights_from_disk,
        "/update_weights_from_shm": s.update_weights_from_shm,
        "/init_weights_update_group": s.init_weights_update_group,
        "/update_weights_from_distributed": s.update_weights_from_distributed,
        "/destroy_weights_update_group": s.destroy_weights_update_group,
        "/begin_weight_update": s.begin_weight_update,
        "/end_weight_update": s.end_weight_update,
        "/get_weights_by_name": s.get_weights_by_name,
        "/update_weight_version": s.update_weight_version,
    }.items():
        app.router.add_post(path, h)

    async def on_cleanup(app: web.Application) -> None:
        await server.close()

    app.on_cleanup.append(on_cleanup)
    return app


def create_server(args: ServerArgs) -> EmbeddedServer:
    """Load the model and start the runner thread (no HTTP yet)."""
    if not Path(args.model_path).is_dir():
        raise SystemExit(f"--model-path {args.model_path!r} is not a directory")
    model, tokenizer, device = load_model(args)
    return EmbeddedServer(args, model, tokenizer, device)


async def serve(args: ServerArgs, stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set (or forever); logs one line when ready."""
    t0 = time.perf_counter()
    server = await asyncio.to_thread(create_server, args)
    app = build_app(server)
    app_runner = web.AppRunner(app, access_log=None)
    await app_runner.setup()
    site = web.TCPSite(app_runner, args.host, args.port)
    try:
        await site.start()
    except OSError as e:
        await app_runner.cleanup()
        raise SystemExit(f"cannot listen on {args.host}:{args.port}: {e}") from None
    n_params = sum(p.numel() for p in server.model.parameters())
    logger.info(
        "arealite embedded server ready on http://%s:%d (model %s, %.2fM params, %s, device %s, loaded in %.1fs)",
        args.host, args.port, args.model_path, n_params / 1e6,
        str(next(server.model.parameters()).dtype).removeprefix("torch."), server.device, time.perf_counter() - t0,
    )
    try:
        await (stop.wait() if stop is not None else asyncio.Event().wait())
    finally:
        await app_runner.cleanup()
