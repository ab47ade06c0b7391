"""The HTTP side of the embedded server: SGLang's routes and JSON shapes on aiohttp.

Handlers validate at the boundary (a bad request is a 400 whose message names
the field, ``body``), then hand work to the runner (the ``ModelRunner`` thread, or any
`GenerationRunner`) and await it.
The weight routes (updates from disk, shared memory or a process group; reading
weights back) are in ``weight_routes``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import torch
from aiohttp import web

from arealite.config.weight_sync import PAUSE_MODES
from arealite.moe.wire import encode_routed_experts
from arealite.utils.heap import freeze_heap
from arealite.utils.json_types import JsonObject

from .args import ServerArgs
from .body import RequestError, check_fields, error_response, json_answer, json_body, off_loop, want
from .limits import LIMITS_KEY, OFFLOAD_BYTES, install_log_filter
from .middleware import make_guard
from .runner import ModelRunner
from .runner_contract import RunnerFactory, Sequence, weight_version_spans
from .strict import SGLangBehaviour
from .generate_request import GenerateInput, RequestCaps, parse_generate
from .sampling import SamplingConfig
from .lora_adapters import LoraRoutes
from .vision import VisionSupport, is_vision_config, load_vision_model
from .startup_request import WarmUp, self_url
from .memory_routes import MemoryRoutes
from .tensor_routes import TensorRoutes
from .weight_routes import WeightRoutes
from .fp8_experts import quantize_experts
from .fp8_linear import quantize_linears
from .weights import model_state, parse_dtype

logger = logging.getLogger("arealite.server")

ENGINE_NAME = "arealite-embedded"

_STATE_KEY = web.AppKey("arealite_server", object)


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
    cfg = AutoConfig.from_pretrained(args.model_path)
    dtype = parse_dtype(args.served_dtype_name(cfg))
    if is_vision_config(cfg):  # vision tower + language model (`arealite.server.vision`)
        model = load_vision_model(args.model_path, dtype).to(device).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype).to(device).eval()
    model.requires_grad_(False)
    if args.quantization == "fp8":
        logger.info("fp8: %d linear layers and %d expert layers stored as block-wise float8_e4m3fn",
                    len(quantize_linears(model)), len(quantize_experts(model)))
    tokenizer = None if args.skip_tokenizer_init else AutoTokenizer.from_pretrained(args.model_path)
    return model, tokenizer, device


class EmbeddedServer:
    """The state behind the routes: model, tokenizer, runner; ``weights`` serves the weight routes."""

    def __init__(self, args: ServerArgs, model: torch.nn.Module, tokenizer, device: torch.device,
                 runner_class: RunnerFactory = ModelRunner):
        """``runner_class`` builds what generates (the model thread; a GPU cost model in
        `arealite.sim`) with `ModelRunner`'s keyword arguments: any `GenerationRunner`."""
        self.args = args
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        cfg = model.config
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.context_length = args.served_context_length(cfg)  # the planner reads the same rule
        self.state = model_state(model)
        self.started = time.time()
        self.limits = args.limits()
        self.caps = RequestCaps(max_prompts=self.limits.max_prompts,
                                max_request_tokens=self.limits.max_request_tokens,
                                context_length=self.context_length)

        eos: set[int] = set()
        for src in (cfg.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                    getattr(tokenizer, "eos_token_id", None)):
            if isinstance(src, int):
                eos.add(src)
            elif isinstance(src, (list, tuple)):
                eos.update(int(t) for t in src)
        pad = cfg.pad_token_id if isinstance(cfg.pad_token_id, int) else getattr(tokenizer, "pad_token_id", None)
        self.runner = runner_class(
            model, device=device, eos_ids=eos, pad_id=int(pad if pad is not None else 0),
            vocab_size=self.vocab_size, max_batch_size=args.max_batch_size,
            random_seed=args.random_seed, weight_version=str(args.weight_version),
            prompt_cache_entries=args.prompt_cache_entries,
            capture_routing=args.enable_return_routed_experts,
        )
        self.behaviour = SGLangBehaviour.from_flags(
            strict=args.strict_sglang, release=args.sglang_version, readback=args.readback_architectures,
            skip_warmup=args.skip_server_warmup, warmup_delay_s=args.warmup_delay_s)
        self.warm_up = WarmUp(self.behaviour)
        self.weights = WeightRoutes(model, self.state, self.runner, behaviour=self.behaviour, device=device,
                                    timeout_s=args.weight_sync_timeout_s, model_path=str(args.model_path))
        self.memory = MemoryRoutes(model, self.runner, behaviour=self.behaviour,
                                   memory_saver=args.enable_memory_saver,
                                   weights_cpu_backup=args.enable_weights_cpu_backup,
                                   own_weights=self.weights.own_weights)
        self.weights.weights_released = lambda: self.memory.weights_released
        self.tensors = TensorRoutes(self.weights, self.memory)
        self.lora = LoraRoutes(model, self.runner)
        # A VLM takes /generate's image_data; a text-only model refuses it (`parse_generate`).
        self.vision = VisionSupport(
            str(args.model_path), cfg, max_image_bytes=getattr(args, "max_image_bytes", None) or (32 << 20),
            max_image_pixels=getattr(args, "max_image_pixels", None) or 4096 * 4096,
            context_length=self.context_length,
        ) if is_vision_config(cfg) else None
        # Cleared by pause_generation, set by continue_generation: SGLang's tokenizer manager
        # holds new requests here (``is_pause``) before it resolves their LoRA adapter.
        self.unpaused = asyncio.Event()
        self.unpaused.set()

    @property
    def model_path(self) -> str:
        """The checkpoint the served weights came from (the last disk update's, once there was one)."""
        return self.weights.model_path

    # -- helpers ----------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def format_output(self, seq: Sequence) -> JsonObject:
        sp = seq.inp.sampling
        meta: JsonObject = {
            "id": seq.inp.rid,
            "finish_reason": seq.finish_reason,
            "prompt_tokens": len(seq.inp.input_ids),
            "completion_tokens": len(seq.output_ids),
            "cached_tokens": seq.cached_tokens,
            "weight_version": seq.weight_version,
            # SGLang 0.5.21's per-token versions (`utils/weight_versions.py`): which weights sampled
            # which output tokens, when they changed under the request (an in_place or retract pause).
            "weight_versions": weight_version_spans(seq),
            "e2e_latency": seq.end_time - seq.start_time,
        }
        if seq.inp.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(seq.output_logprobs, seq.output_ids)]
            if seq.inp.top_logprobs_num:
                meta["output_top_logprobs"] = seq.output_top_logprobs or []
            if seq.input_logprobs is not None:
                ids = seq.inp.input_ids[seq.inp.logprob_start_len:]
                meta["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(seq.input_logprobs, ids)]
        if seq.inp.return_routed_experts:
            meta["routed_experts"] = encode_routed_experts(seq.routed_experts)
        out: JsonObject = {}
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
        if self.warm_up.starting:
            return web.Response(status=503)  # SGLang: ServerStatus.Starting answers at once
        if self.behaviour.health_generates:
            return await self._health_by_generation()
        return web.Response(status=200)

    async def _health_by_generation(self) -> web.Response:
        """SGLang's ``/health``: one greedy token; while paused it waits, then answers 503."""
        rid = f"HEALTH_CHECK_{time.monotonic_ns()}"
        inp = GenerateInput(rid=rid, input_ids=[0], sampling=SamplingConfig(max_new_tokens=1, temperature=0.0))
        try:
            await asyncio.wait_for(self.runner.generate(inp), timeout=self.behaviour.health_timeout_s)
        except (asyncio.TimeoutError, RuntimeError):
            await self.runner.call(lambda: self.runner.abort(rid, "health check timed out"))
            logger.error("health check failed: no token within %gs", self.behaviour.health_timeout_s)
            return web.Response(status=503)
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        r = self.runner
        if self.warm_up.starting:
            return web.Response(status=503)
        if self.behaviour.strict:
            return await self._health_by_generation()
        if r.pause.paused or r.pause.in_update_bracket:
            # Generation is intentionally held; the server itself is fine.
            return web.json_response({"status": "paused"})
        inp = GenerateInput(rid=f"health-{time.monotonic_ns()}", input_ids=[0],
                            sampling=SamplingConfig(max_new_tokens=1, temperature=0.0))
        try:
            await asyncio.wait_for(r.generate(inp), timeout=30)
        except (asyncio.TimeoutError, RuntimeError) as e:
            return error_response(f"health generation failed: {e!r}", status=503)
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        """SGLang's ``/ready``: 200 once the start-up warm-up is over, while not paused."""
        return web.Response(status=200 if self.warm_up.up and not self.runner.pause.paused else 503)

    async def get_model_info(self, request: web.Request) -> web.Response:
        cfg = self.model.config
        return web.json_response({
            "model_path": self.model_path,
            "tokenizer_path": None if self.tokenizer is None else str(self.args.model_path),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.runner.weight_version,
            "has_image_understanding": self.vision is not None,
            "has_audio_understanding": False,
            "model_type": getattr(cfg, "model_type", None),
            "architectures": getattr(cfg, "architectures", None),
        })

    async def get_server_info(self, request: web.Request) -> web.Response:
        a, r = self.args, self.runner
        return web.json_response({
            "version": self.behaviour.release,
            "strict_sglang": self.behaviour.strict,
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
                "paused": r.pause.paused, "in_weight_update": r.pause.in_update_bracket, **r.stats,
                "memory": self.memory.status(),
                "prompt_cache_entries": len(r.prompt_cache), "prompt_cache_hits": r.prompt_cache.hits,
                "prompt_cache_misses": r.prompt_cache.misses,
                # CPU seconds of the whole server process: lets benchmarks on a
                # busy machine compare work done rather than contended wall time.
                "cpu_time_s": time.process_time(),
            }],
        })

    async def openapi(self, request: web.Request) -> web.Response:
        """The routes served, in the shape FastAPI gives ``/openapi.json`` (clients detect features)."""
        paths: dict[str, JsonObject] = {}
        for route in request.app.router.routes():
            path = route.resource.canonical if route.resource is not None else None
            if path is None or route.method in ("HEAD", "*"):
                continue
            paths.setdefault(path, {})[route.method.lower()] = {"summary": path.strip("/")}
        return web.json_response({
            "openapi": "3.1.0",
            "info": {"title": ENGINE_NAME, "version": self.behaviour.release},
            "paths": dict(sorted(paths.items())),
        })

    async def generate(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        images = self.vision.take_image_data(body) if self.vision is not None and isinstance(body, dict) else None

        def parse() -> tuple[list[GenerateInput], bool, list[str | None]]:
            inputs, batch = parse_generate(
                body, vocab_size=self.vocab_size, context_length=self.context_length,
                encode=self.encode if self.tokenizer is not None else None, caps=self.caps,
                routed_experts=self.args.enable_return_routed_experts,
            )
            if self.vision is not None:  # every prompt: its image blocks must match its images
                self.vision.attach(inputs, images, batch)
            return inputs, batch, self.lora.lora_names(body, len(inputs))

        # Tokenizing and checking a large request (or decoding images) runs off the loop; a
        # small one is cheaper inline than a thread hop.
        big = request.content_length is None or request.content_length > OFFLOAD_BYTES or images is not None
        inputs, batch, names = await off_loop(parse) if big else parse()
        self.memory.check_generate(paused=not self.unpaused.is_set())
        if any(names):  # as SGLang: the adapter is looked up once a pause is over
            await self.unpaused.wait()
            for inp, adapter in zip(inputs, self.lora.lora.resolve(names)):
                inp.lora = adapter
        # A cancelled request (its client left) takes its sequences out of the batch.
        seqs = await asyncio.gather(*(self.runner.generate(i) for i in inputs))
        outs = [self.format_output(s) for s in seqs]
        return json_answer(outs if batch else outs[0])

    async def flush_cache(self, request: web.Request) -> web.Response:
        r = self.runner
        if r.pause.holds_old_kv and r.n_running:  # SGLang's Scheduler.flush_cache: not while requests run
            return web.Response(status=400, text=f"Cache not flushed because there are pending requests. "
                                                 f"#running-req: {r.n_running} (paused in_place)\n")
        n = await self.runner.call(self.runner.prompt_cache.clear)
        return web.json_response({"success": True, "message": f"prompt cache flushed ({n} prompts)"})

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await json_body(request, allow_empty=True)
        check_fields(body, set(), {"mode"}, "pause_generation")
        mode = want(body, "mode", str, "pause_generation", "abort")
        if mode not in PAUSE_MODES:
            raise RequestError(f"pause_generation: mode {mode!r} is not supported (use one of {', '.join(PAUSE_MODES)})")
        self.unpaused.clear()
        n = await self.runner.call(lambda: self.runner.set_paused(True, mode))
        return web.json_response({"success": True, "message": f"generation paused ({mode}); {n} running requests affected"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        body = await json_body(request, allow_empty=True)
        check_fields(body, set(), set(), "continue_generation")
        await self.runner.call(lambda: self.runner.set_paused(False))
        self.unpaused.set()
        return web.json_response({"success": True, "message": "generation continued"})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        check_fields(body, set(), {"rid", "abort_all", "abort_message"}, "abort_request")
        rid = want(body, "rid", str, "abort_request")
        abort_all = want(body, "abort_all", bool, "abort_request", False)
        if not abort_all and not rid:
            raise RequestError("abort_request: give a non-empty 'rid' (prefix) or 'abort_all': true")
        msg = want(body, "abort_message", str, "abort_request", "aborted by abort_request")
        n = await self.runner.call(lambda: self.runner.abort(None if abort_all else rid, msg))
        return web.json_response({"success": True, "num_aborted": n})

    async def close(self) -> None:
        await asyncio.to_thread(self.runner.shutdown)
        self.weights.close()


def build_app(server: EmbeddedServer) -> web.Application:
    """The aiohttp application serving ``server``'s routes."""
    limits = server.limits
    # client_max_size caps what aiohttp reads of any body, chunked ones included.
    app = web.Application(middlewares=[make_guard(limits, server.args.api_key)],
                          client_max_size=limits.max_body_bytes)
    app[_STATE_KEY] = server
    app[LIMITS_KEY] = limits
    s = server
    both = {"/health": s.health, "/health_generate": s.health_generate,
            "/model_info": s.get_model_info, "/get_model_info": s.get_model_info,
            "/server_info": s.get_server_info, "/get_server_info": s.get_server_info,
            "/flush_cache": s.flush_cache, **s.memory.routes()}
    for path, h in both.items():
        app.router.add_get(path, h)
        app.router.add_post(path, h)
    app.router.add_get("/ready", s.ready)
    if s.behaviour.openapi:
        app.router.add_get("/openapi.json", s.openapi)
    for path, h in {
        "/generate": s.generate,
        "/pause_generation": s.pause_generation,
        "/continue_generation": s.continue_generation,
        "/abort_request": s.abort_request,
        **s.weights.routes(),
        **{path: s.weights.one_at_a_time(h) for path, h in s.tensors.routes().items()},
        **s.lora.routes(),
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
    install_log_filter("arealite.server", "aiohttp.server", "aiohttp.web", "aiohttp.access")
    if args.api_key_on_argv:
        logger.warning("the API key was given with --api-key: every user of this host can read it in the "
                       "process list; pass it in $AREALITE_SERVER_API_KEY or --api-key-file instead")
    server = await asyncio.to_thread(create_server, args)
    app = build_app(server)
    # keepalive_timeout also closes a new connection that sends no complete request head in
    # time (slow-header clients); handler_cancellation stops a /generate whose client left;
    # after a refused body, at most a second of its rest is read (and dropped) before closing,
    # so that the client sees the answer rather than a reset; bodies are never inflated (the
    # guard refuses any Content-Encoding).
    app_runner = web.AppRunner(app, access_log=None, keepalive_timeout=args.idle_timeout_s,
                               handler_cancellation=True, lingering_time=1.0, auto_decompress=False)
    await app_runner.setup()
    site = web.TCPSite(app_runner, args.host, args.port)
    try:
        await site.start()
    except OSError as e:
        await app_runner.cleanup()
        raise SystemExit(f"cannot listen on {args.host}:{args.port}: {e}") from None
    n_params = sum(p.numel() for p in server.model.parameters())
    if args.freeze_gc:
        # The model, torch and aiohttp stay alive for the server's life: without this, the
        # collector's full scans of them stop generation for ~0.2 s every few seconds.
        await asyncio.to_thread(freeze_heap)
    logger.info(
        "arealite embedded server ready on http://%s:%d (model %s, %.2fM params, %s, device %s, loaded in %.1fs)",
        args.host, args.port, args.model_path, n_params / 1e6,
        str(next(server.model.parameters()).dtype).removeprefix("torch."), server.device, time.perf_counter() - t0,
    )
    stop = stop if stop is not None else asyncio.Event()
    # Strict mode: SGLang's start-up warm-up; when it fails the server stops, as SGLang's does.
    warm_up = asyncio.create_task(server.warm_up.run(self_url(args.host, args.port), args.api_key, stop.set))
    try:
        await stop.wait()
    finally:
        warm_up.cancel()
        await app_runner.cleanup()
    if server.warm_up.status == "failed":
        raise SystemExit(f"arealite embedded server on {args.host}:{args.port}: {server.warm_up.failure}")
