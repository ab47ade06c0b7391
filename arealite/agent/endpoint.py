"""The OpenAI-compatible endpoint agents call during rollout, served on the controller's event loop.

Routes (each also under ``/s/<session>/v1/...``, the session carried by the URL):

- ``POST /v1/chat/completions``: messages rendered token-exactly (`arealite.agent.chat`),
  tool calls parsed (`arealite.agent.tool_parsers`), JSON or a server-sent event stream;
- ``POST /v1/completions``: a prompt string (or token ids);
- ``GET /v1/models``: the one served model.

Every generation goes through the inference client the episode was given
(``client.agenerate``): routing, retries, interruption by weight updates and per-token
versions all apply; the experts an MoE model routed each token to, when the server reports
them, stay with each call (routing replay). Each request belongs to a session
(`arealite.agent.session`), found by its API key or URL; its calls are recorded there for
the workflow. Errors come back in OpenAI's shape (`arealite.agent.errors`), so the
``openai`` client raises its usual exceptions.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import TYPE_CHECKING, Awaitable, Callable

from aiohttp import web

from arealite.agent.chat import ChatRenderer, message_key, normalize_messages, tools_key
from arealite.agent.errors import RequestError, invalid_session
from arealite.agent.image_parts import ImagePolicy, render_images, resolve_images
from arealite.agent.protocol import (
    Choice, ParsedRequest, SamplingPolicy, assistant_message, chat_chunks, chat_response,
    completion_chunks, completion_response, finish_choice, parse_request,
)
from arealite.agent.session import CallKey, LLMCall, Session, SessionStore
from arealite.agent.streaming import LiveStream, sse
from arealite.agent.tool_parsers import make_tool_parser
from arealite.api.contracts import InferenceClient
from arealite.api.types import GenerationRequest
from arealite.config.agent import AgentConfig
from arealite.config.schema import GenerationConfig
from arealite.inference_client.errors import BadRequestError, GenerationError, NoHealthyServerError
from arealite.moe.trajectory import kept_routed_experts
from arealite.utils.tokenizer import prepare_decode
from arealite.workflow.common import sampling_from_config
from arealite.inference_client.wire import loads as strict_json  # no NaN, bounded nesting

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from arealite.vision.prompt import VisionPrompt

logger = logging.getLogger("arealite.agent")

__all__ = ["AgentEndpoint"]

_COUNTERS = ("requests", "stream_requests", "request_errors", "unknown_session", "generation_errors", "calls",
             "tool_calls", "tool_calls_malformed", "sampling_overridden", "max_tokens_clamped", "rerendered",
             "prompt_tokens", "completion_tokens", "stream_mismatched")


class AgentEndpoint:
    """An aiohttp server on the running event loop; `start()` it there, `aclose()` it there."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, generation: GenerationConfig, agent: AgentConfig,
                 processor=None):
        self.tok = tokenizer
        self.agent = agent
        self.processor = processor  # a vision-language model's processor: chat image_url parts (else refused)
        self.images = ImagePolicy(agent.allow_remote_images, agent.max_image_bytes)
        self.renderer = ChatRenderer(tokenizer)
        self.parser = make_tool_parser(agent.tool_parser)
        prepare_decode(tokenizer)
        cap = agent.max_tokens or generation.max_new_tokens
        self.policy = SamplingPolicy(sampling_from_config(generation, tokenizer), agent.request_sampling,
                                     cap, agent.max_n)
        eot = self.renderer.end_of_turn
        self._chat_stop_ids = [eot] if eot is not None else []
        self.sessions = SessionStore()
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self.url: str | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._guard: asyncio.Task | None = None
        self._closers: list[Callable[[], Awaitable[object]]] = []

    # ------------------------------------------------------------ lifecycle
    @property
    def running(self) -> bool:
        return self._runner is not None

    async def start(self) -> "AgentEndpoint":
        """Listen on ``agent.host:agent.port`` (0: a free port). The server stops with `aclose`,
        or when the loop's tasks are cancelled (the controller's shutdown)."""
        app = web.Application(client_max_size=64 * 2**20)
        for prefix in ("", "/s/{session}"):
            app.router.add_post(prefix + "/v1/chat/completions", self._chat)
            app.router.add_post(prefix + "/v1/completions", self._completions)
            app.router.add_get(prefix + "/v1/models", self._models)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.agent.host, self.agent.port).start()
        except OSError as e:
            if not self.agent.port:
                await runner.cleanup()
                raise
            # A fixed port serves the first workflow (training); the evaluation copy takes a free one.
            logger.warning("agent.port=%d is taken (%s); the endpoint takes a free port", self.agent.port, e)
            await web.TCPSite(runner, self.agent.host, 0).start()
        port = runner.addresses[0][1]
        host = self.agent.host if self.agent.host not in ("0.0.0.0", "::") else "127.0.0.1"
        self.url = f"http://{host}:{port}"
        self._runner, self.loop = runner, asyncio.get_running_loop()
        self._guard = self.loop.create_task(self._hold(), name="arealite-agent-endpoint")
        logger.info("OpenAI-compatible endpoint at %s/v1", self.url)
        return self

    async def _hold(self) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await self._cleanup()

    def on_close(self, fn: Callable[[], Awaitable[object]]) -> None:
        """Await ``fn()`` when the endpoint stops (e.g. to close the agents' HTTP client)."""
        self._closers.append(fn)

    async def _cleanup(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        closers, self._closers = self._closers, []
        for fn in closers:
            try:
                await fn()
            except Exception as e:  # closing must not fail the controller's shutdown
                logger.warning("closing %s failed: %r", fn, e)

    async def aclose(self) -> None:
        if self._guard is not None and not self._guard.done():
            self._guard.cancel()
            await asyncio.gather(self._guard, return_exceptions=True)
        await self._cleanup()

    # ------------------------------------------------------------ sessions
    def open_session(self, client: InferenceClient, affinity_key: str) -> Session:
        return self.sessions.open(client, affinity_key, self.agent.max_calls_per_episode)

    def close_session(self, s: Session) -> None:
        self.sessions.close(s)

    def base_url(self, s: Session) -> str:
        """The ``base_url`` of a client of session ``s`` (the session in the URL)."""
        return f"{self.url}/s/{s.id}/v1"

    def _session(self, request: web.Request) -> Session:
        auth = request.headers.get("Authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else None
        sid = request.match_info.get("session")
        s = self.sessions.find(sid, key)
        if s is None:
            self.counters["unknown_session"] += 1
            raise invalid_session(f"session {sid!r}" if sid is not None else "no session key" if key is None
                                  else f"{key[:12]}...")
        return s

    # ------------------------------------------------------------ routes
    async def _models(self, request: web.Request) -> web.Response:
        name = self.agent.served_model_name
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "arealite"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completion")

    async def _serve(self, request: web.Request, kind: str) -> web.StreamResponse:
        self.counters["requests"] += 1
        try:
            session = self._session(request)
            try:
                body = await request.json(loads=strict_json)
            except ValueError:
                raise RequestError("We could not parse the JSON body of your request.") from None
            req = parse_request(kind, body, self.policy, self._chat_stop_ids if kind == "chat" else [], self.images)
            if len(session.calls) + req.n > session.max_calls:
                raise RequestError(f"this episode made {len(session.calls)} calls; agent.max_calls_per_episode="
                                   f"{session.max_calls} allows no more", code="calls_exhausted")
            if req.stream:
                return await self._stream(request, session, req)
            rid, prompt_len, choices = await self._generate(session, req)
        except RequestError as e:
            self.counters["request_errors"] += 1
            return web.json_response(e.body(), status=e.status)
        except BadRequestError as e:  # the inference server refused it (a prompt too long, say)
            self.counters["request_errors"] += 1
            return web.json_response(RequestError(str(e)).body(), status=400)
        except (GenerationError, NoHealthyServerError) as e:
            self.counters["generation_errors"] += 1
            return web.json_response({"error": {"message": str(e), "type": "server_error", "param": None,
                                                "code": None}}, status=503)
        shape = chat_response if kind == "chat" else completion_response
        return web.json_response(shape(rid, req, self.tok, choices, prompt_len))

    async def _stream(self, request: web.Request, s: Session, req: ParsedRequest) -> web.StreamResponse:
        """Server-sent events: the opening chunk and each generated segment's text as they come
        (`arealite.agent.streaming`), the rest when the completion is done. An error before the
        first event is an ordinary error response; after it, an ``error`` event ends the stream."""
        self.counters["stream_requests"] += 1
        live = LiveStream(req, self.tok, self.parser)
        rid = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + secrets.token_hex(12)
        wake = asyncio.Event()

        def hook(i: int) -> Callable[[list[int]], None]:
            add = live.hook(i)
            return lambda ids: (add(ids), wake.set())

        gen = asyncio.ensure_future(self._generate(s, req, rid, [hook(i) for i in range(req.n)]))
        resp: web.StreamResponse | None = None
        try:
            while not gen.done():
                waiter = asyncio.ensure_future(wake.wait())
                await asyncio.wait({gen, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                if wake.is_set() and not gen.done():
                    wake.clear()
                    chunks = live.early_chunks(rid, opened=resp is not None)
                    if resp is None:
                        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                           "Cache-Control": "no-cache"})
                        await resp.prepare(request)
                    for chunk in chunks:
                        await resp.write(sse(chunk))
            _, prompt_len, choices = gen.result()
        except (RequestError, BadRequestError, GenerationError, NoHealthyServerError) as e:
            if resp is None:
                raise
            self.counters["generation_errors"] += 1
            await resp.write(sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}}))
            await resp.write_eof()
            return resp
        finally:
            if not gen.done():  # the agent hung up: stop generating
                gen.cancel()
        opened = resp is not None  # the opening chunks went out with the first segment
        if resp is None:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
        chunks = chat_chunks if req.kind == "chat" else completion_chunks
        out = list(chunks(rid, req, self.tok, live.rest_of(choices), prompt_len))
        self.counters["stream_mismatched"] += live.mismatched
        for chunk in (live.without_opening(out) if opened else out):
            await resp.write(sse(chunk))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # ------------------------------------------------------------ generation
    async def _generate(self, s: Session, req: ParsedRequest, rid: str | None = None,
                        hooks: list[Callable[[list[int]], None]] | None = None) -> tuple[str, int, list[Choice]]:
        """Render the prompt, generate ``n`` choices, record them in the session. ``hooks[i]``
        gets choice i's tokens segment by segment (clients that support it)."""
        with_images = req.kind == "chat" and any("images" in m for m in req.messages)
        prompt_ids, parent, key_prefix, vision = (await self._vision_prompt(s, req) if with_images
                                                  else (*self._prompt(s, req), None))
        images = vision.image_data if vision is not None else None
        task = asyncio.current_task()
        s.tasks.add(task)
        try:
            comps = await asyncio.gather(*(
                s.client.agenerate(GenerationRequest(list(prompt_ids), req.sampling, affinity_key=s.affinity_key,
                                                     metadata={"on_segment": hooks[i]} if hooks else {},
                                                     top_logprobs=req.top_logprobs, image_data=images))
                for i in range(req.n)))
        finally:
            s.tasks.discard(task)
        if s.closed:
            raise invalid_session(f"session {s.id!r} ended while the call ran")
        rid = rid or ("chatcmpl-" if req.kind == "chat" else "cmpl-") + secrets.token_hex(12)
        choices = [finish_choice(i, c, req, self.tok, self.parser) for i, c in enumerate(comps)]
        for c in choices:
            if req.kind == "chat":
                reply = message_key(normalize_messages([assistant_message(c)])[0])
                key: CallKey = (key_prefix[0], key_prefix[1] + [reply])
            else:
                key = key_prefix + c.text if isinstance(key_prefix, str) else None
            s.record(LLMCall(rid, 0, list(prompt_ids), c.output_ids, c.logprobs, c.versions, c.finish_reason,
                             parent, key, tool_calls=len(c.tool_calls), vision=vision,
                             routed_experts=kept_routed_experts(c.completion, len(c.output_ids))))
        self._count(req, choices, len(prompt_ids))
        return rid, len(prompt_ids), choices

    async def _vision_prompt(self, s: Session, req: ParsedRequest) -> tuple[list[int], int | None, CallKey, VisionPrompt]:
        """`_prompt` of a chat with images: a conversation continues its parent call token-exactly
        (and keeps its images) while the new messages bring no image; else the processor renders it."""
        if req.tools:
            raise RequestError("tools together with image_url parts are not supported", param="tools")
        await resolve_images(req.messages, self.images)
        mkeys = [message_key(m) for m in req.messages]
        tkey = tools_key(req.tools, req.template_kwargs)
        found = s.chat_parent(tkey, mkeys)
        if found is not None and found[0].vision is not None and not any("images" in m for m in req.messages[found[1]:]):
            call, at = found
            piece = self.renderer.continuation_ids(req.messages, req.tools, req.template_kwargs, at, call.output_ids)
            return call.prompt_ids + call.output_ids + piece, call.index, (tkey, mkeys), call.vision
        self.counters["rerendered"] += bool(s.calls)
        vp = await asyncio.to_thread(render_images, self.processor, req.messages)
        return list(vp.input_ids), None, (tkey, mkeys), vp

    def _prompt(self, s: Session, req: ParsedRequest) -> tuple[list[int], int | None, CallKey]:
        """Prompt token ids, the call they continue (index) and the key prefix of the new calls."""
        if req.kind == "chat":
            mkeys = [message_key(m) for m in req.messages]
            tkey = tools_key(req.tools, req.template_kwargs)
            found = s.chat_parent(tkey, mkeys)
            if found is None:
                self.counters["rerendered"] += bool(s.calls)
                return self.renderer.prompt_ids(req.messages, req.tools, req.template_kwargs), None, (tkey, mkeys)
            call, at = found
            piece = self.renderer.continuation_ids(req.messages, req.tools, req.template_kwargs, at, call.output_ids)
            return call.prompt_ids + call.output_ids + piece, call.index, (tkey, mkeys)
        if isinstance(req.prompt, list):
            for call in reversed(s.calls):
                done = call.prompt_ids + call.output_ids
                if len(req.prompt) > len(done) and req.prompt[: len(done)] == done:
                    return list(req.prompt), call.index, None
            return list(req.prompt), None, None
        found_text = s.text_parent(req.prompt)
        if found_text is None:
            return self.renderer.encode(req.prompt), None, req.prompt
        call, rest = found_text
        return call.prompt_ids + call.output_ids + self.renderer.encode(rest), call.index, req.prompt

    def _count(self, req: ParsedRequest, choices: list[Choice], prompt_len: int) -> None:
        c = self.counters
        c["calls"] += len(choices)
        c["sampling_overridden"] += req.overridden
        c["max_tokens_clamped"] += req.clamped
        c["prompt_tokens"] += prompt_len
        for ch in choices:
            c["tool_calls"] += len(ch.tool_calls)
            c["tool_calls_malformed"] += ch.malformed_tool_call
            c["completion_tokens"] += len(ch.output_ids)

    def stats(self) -> dict[str, int]:
        return dict(self.counters)
