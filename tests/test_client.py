"""SGLangClient against fake SGLang servers (real HTTP on 127.0.0.1).

The fakes speak the SGLang protocol subset the client uses and let a test inject
faults (500, garbage, hangs, 400, aborts) and watch what the client sends.
Their "model" writes token f(p) at absolute position p, so a generation resumed
after an abort must reproduce the uninterrupted one exactly.
"""

from __future__ import annotations

import asyncio
import gc
import time
import warnings

import numpy as np
import pytest
from aiohttp import web

from arealite.api.types import GenerationRequest, SamplingParams
from arealite.config.schema import RolloutConfig
from arealite.inference_client.sglang_client import (
    BadRequestError,
    GenerationError,
    NoHealthyServerError,
    SGLangClient,
    ServerAdminError,
    ServerStartupError,
    parse_sglang_version,
)
from tests.conftest import free_port

EOS = 2


def tok(p: int) -> int:
    """The fake model's token at absolute position p (never EOS)."""
    return (p * 7 + 3) % 97 + 3


class FakeSGLang:
    """A programmable SGLang-like server.

    ``actions`` is a queue consumed by /generate calls: None (normal), "500",
    "garbage", "hang", "400", "short" (a batch answered with one entry too few),
    "abort0" (abort, no tokens), "queued" (no tokens, aborted
    by the next pause), "abort_eos" (abort
    after two tokens, the last one EOS). ``always`` applies when the queue is empty.
    """

    def __init__(self, version: str = "0.5.23", tp_size: int | None = 1, token_delay: float = 0.0,
                 api_key: str | None = None):
        self.version_text = version
        self.tp_size = tp_size
        self.token_delay = token_delay
        self.api_key = api_key
        self.actions: list[str | None] = []
        self.always: str | None = None
        self.weight_version = "0"
        self.admin_fail: dict[str, str] = {}  # route -> message (success false)
        self.generate_payloads: list[dict] = []  # one per request, a batch's split
        self.generate_bodies: list[dict] = []  # one per HTTP call
        self.refuse_batches = False  # answer a batch (a list of rids) with a 400
        self.calls: list[tuple[str, object]] = []
        self.auth_headers: list[str | None] = []
        self.inflight = 0
        self.max_inflight = 0
        self.max_running_requests: int | None = None  # reported in /server_info when set
        self.paused = False
        self._abort = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._release = asyncio.Event()  # set at stop(): ends hanging handlers
        self.runner: web.AppRunner | None = None
        self.port: int | None = None

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> "FakeSGLang":
        app = web.Application(middlewares=[self._auth])
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", self._ok)
        app.router.add_get("/get_server_info", self._server_info)
        for route in ("pause_generation", "continue_generation", "flush_cache", "update_weights_from_disk",
                      "init_weights_update_group", "update_weights_from_distributed",
                      "begin_weight_update", "end_weight_update", "get_weights_by_name",
                      "update_weight_version", "destroy_weights_update_group"):
            app.router.add_post("/" + route, self._admin)
        self._release = asyncio.Event()
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        self._release.set()
        self._abort.set()
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    @web.middleware
    async def _auth(self, request, handler):
        got = request.headers.get("Authorization")
        self.auth_headers.append(got)
        if self.api_key is not None and got != f"Bearer {self.api_key}":
            return web.json_response({"error": {"message": "Unauthorized"}}, status=401)
        return await handler(request)

    async def _ok(self, request):
        return web.Response(text="ok")

    async def _server_info(self, request):
        info = {"version": self.version_text, "engine": "fake"}
        if self.tp_size is not None:
            info["tp_size"] = self.tp_size
        if self.max_running_requests is not None:
            info["max_running_requests"] = self.max_running_requests
        return web.json_response(info)

    async def _admin(self, request):
        route = request.path
        body = await request.json() if request.can_read_body else None
        self.calls.append((route, body))
        if route in self.admin_fail:
            return web.json_response({"success": False, "message": self.admin_fail[route]})
        if route == "/pause_generation":
            self.paused = True
            self._resumed.clear()
            self._abort.set()
        elif route == "/continue_generation":
            self.paused = False
            self._abort.clear()
            self._resumed.set()
        elif route == "/update_weight_version":
            self.weight_version = body["new_version"]
        elif route == "/get_weights_by_name":
            return web.json_response([0.5, 0.25][: body["truncate_size"]])
        return web.json_response({"success": True, "message": "ok"})

    def _reply(self, ids, start, finish):
        meta = {
            "finish_reason": {"type": finish},
            "prompt_tokens": start,
            "completion_tokens": len(ids),
            "output_token_logprobs": [[-0.01 * (start + i), t, None] for i, t in enumerate(ids)],
            "weight_version": self.weight_version,
        }
        return {"output_ids": ids, "meta_info": meta}

    async def _generate(self, request):
        body = await request.json()
        self.generate_bodies.append(body)
        if self.refuse_batches and isinstance(body.get("rid"), list):
            return web.json_response({"error": {"message": "rid must be a string"}}, status=400)
        items = split_batch(body)
        self.generate_payloads.extend(items or [body])
        actions = [self.actions.pop(0) if self.actions else self.always for _ in items or [body]]
        # As SGLang: one item that fails fails the whole request.
        if "500" in actions:
            return web.Response(status=500, text="internal error: CUDA out of memory")
        if "400" in actions:
            return web.json_response({"error": {"message": "Unknown sampling parameter 'foo'"}}, status=400)
        if "429" in actions:
            return web.Response(status=429, text="too many requests")
        if "302" in actions:
            return web.Response(status=302, headers={"Location": "/elsewhere"}, text="moved")
        if "garbage" in actions:
            return web.Response(text="{not json at all", content_type="application/json")
        if "hang" in actions:
            await self._release.wait()
            return web.Response(status=503)
        replies = await asyncio.gather(*(self._one(p, a) for p, a in zip(items or [body], actions)))
        if "short" in actions:  # a batch answered with one entry missing
            return web.json_response(replies[:-1])
        return web.json_response(replies if items is not None else replies[0])

    async def _one(self, payload, action):
        start = len(payload["input_ids"])
        if action == "abort0":
            return self._reply([], start, "abort")
        if action == "abort_eos":
            return self._reply([tok(start), EOS], start, "abort")
        if action == "queued":  # waits in the server's queue until a pause drops it (SGLang's abort mode)
            await self._abort.wait()
            return self._reply([], start, "abort")
        await self._resumed.wait()  # a paused server holds new requests
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            n = payload["sampling_params"]["max_new_tokens"]
            ids = []
            for i in range(n):
                if self._abort.is_set():
                    return self._reply(ids, start, "abort")
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
                ids.append(tok(start + i))
            return self._reply(ids, start, "length")
        finally:
            self.inflight -= 1


def split_batch(body: dict) -> list[dict] | None:
    """A batched /generate body as its single requests (None: not a batch), checked as SGLang's
    ``GenerateReqInput.normalize_batch_and_arguments`` checks it."""
    ids = body["input_ids"]
    if not (isinstance(ids, list) and ids and isinstance(ids[0], list)):
        return None
    n = len(ids)
    rids = body.get("rid")
    if isinstance(rids, list) and len(rids) != n:
        raise web.HTTPBadRequest(text="The specified rids length mismatch with the batch_size for batch processing.")
    if isinstance(rids, list) and len(set(rids)) != n:
        raise web.HTTPBadRequest(text=f"Duplicate request IDs detected within the request: {rids}")

    def item(key: str, i: int):
        v = body.get(key)
        return v[i] if isinstance(v, list) else v

    out = []
    for i in range(n):
        one = {k: item(k, i) for k in body if k != "input_ids"}
        if not isinstance(rids, list) and rids is not None:
            one["rid"] = f"{rids}_{i}"
        one["input_ids"] = ids[i]
        out.append(one)
    return out


def cfg(**kw) -> RolloutConfig:
    base = dict(request_timeout_s=5.0, request_retries=3, retry_backoff_s=0.01)
    base.update(kw)
    return RolloutConfig(**base)


def req(n_prompt: int = 5, max_new: int = 8, **kw) -> GenerationRequest:
    return GenerationRequest(input_ids=list(range(10, 10 + n_prompt)),
                             sampling=SamplingParams(max_new_tokens=max_new), **kw)


@pytest.fixture
async def fakes(request):
    started: list[FakeSGLang] = []

    async def make(n: int = 1, **kw) -> list[FakeSGLang]:
        out = [await FakeSGLang(**kw).start() for _ in range(n)]
        started.extend(out)
        return out

    yield make
    for f in started:
        await f.stop()


# ----------------------------------------------------------------- basics


async def test_generate_returns_tokens_logprobs_versions(fakes):
    (f,) = await fakes(1)
    f.weight_version = "7"
    async with SGLangClient([f"http://{f.addr}/"], cfg()) as eng:
        await eng.initialize(timeout=5)
        r = req(n_prompt=5, max_new=6)
        c = await eng.agenerate(r)
    assert c.rid == r.rid and c.server == f.addr and c.finish_reason == "length"
    assert c.input_ids == r.input_ids
    assert c.output_ids == [tok(5 + i) for i in range(6)]
    assert c.output_logprobs == pytest.approx([-0.01 * (5 + i) for i in range(6)])
    assert c.output_versions == [7] * 6 and c.n_interruptions == 0 and c.latency_s > 0
    sent = f.generate_payloads[0]
    assert sent["return_logprob"] is True and sent["rid"] == r.rid
    assert sent["sampling_params"]["max_new_tokens"] == 6


async def test_greedy_sampling_is_sent_as_temperature_zero(fakes):
    (f,) = await fakes(1)
    async with SGLangClient([f.addr], cfg()) as eng:
        r = req()
        r.sampling = r.sampling.replace(temperature=0.7, greedy=True)
        await eng.agenerate(r)
    assert f.generate_payloads[0]["sampling_params"]["temperature"] == 0.0


async def test_bad_request_input_fails_before_http(fakes):
    (f,) = await fakes(1)
    async with SGLangClient([f.addr], cfg()) as eng:
        with pytest.raises(ValueError, match="input_ids"):
            await eng.agenerate(GenerationRequest(input_ids=[]))
        with pytest.raises(ValueError, match="max_new_tokens"):
            await eng.agenerate(GenerationRequest(input_ids=[1], sampling=SamplingParams(max_new_tokens=0)))
        with pytest.raises(ValueError, match="input_ids must be a list of token ids"):
            await eng.agenerate(GenerationRequest(input_ids=["a", "b"]))
    async with SGLangClient([f.addr], cfg()) as eng:  # numpy integer ids, anywhere, are converted
        c = await eng.agenerate(GenerationRequest(input_ids=np.arange(3, 6).tolist()[:1] + [np.int64(4)]))
        d = await eng.agenerate(GenerationRequest(input_ids=[1, np.int64(2), 3]))
    assert c.input_ids == [3, 4] and type(c.input_ids[1]) is int
    assert d.input_ids == [1, 2, 3] and {type(t) for t in d.input_ids} == {int}
    assert len(f.generate_payloads) == 2


def test_address_validation():
    with pytest.raises(ValueError, match="host:port"):
        SGLangClient(["localhost"])
    with pytest.raises(ValueError, match="at least one"):
        SGLangClient([])
    with pytest.raises(ValueError, match="twice"):
        SGLangClient(["127.0.0.1:5", "http://127.0.0.1:5"])


# ----------------------------------------------------------------- faults


async def test_500_is_retried_on_another_server(fakes):
    a, b = await fakes(2)
    a.actions = ["500"]
    async with SGLangClient([a.addr, b.addr], cfg()) as eng:
        c = await eng.agenerate(req())
        st = eng.stats()
    assert c.server == b.addr and c.output_ids == [tok(5 + i) for i in range(8)]
    assert len(a.generate_payloads) == 1 and len(b.generate_payloads) == 1
    assert st["retries"] == 1 and st["http_5xx"] == 1 and st["failed"] == 0


async def test_garbage_json_is_retried_then_named_in_the_error(fakes):
    a, b = await fakes(2)
    a.always = b.always = "garbage"
    async with SGLangClient([a.addr, b.addr], cfg(request_retries=2)) as eng:
        with pytest.raises(GenerationError) as ei:
            await eng.agenerate(req())
        st = eng.stats()
    msg = str(ei.value)
    assert f"{a.addr}/generate" in msg and f"{b.addr}/generate" in msg and "not JSON" in msg
    assert len(a.generate_payloads) + len(b.generate_payloads) == 3  # 1 try + 2 retries
    assert st["malformed"] == 3 and st["failed"] == 1 and st["retries"] == 2


async def test_hanging_server_times_out_and_request_moves(fakes):
    a, b = await fakes(2)
    a.actions = ["hang"]
    async with SGLangClient([a.addr, b.addr], cfg(request_timeout_s=0.3)) as eng:
        t0 = time.monotonic()
        c = await eng.agenerate(req())
        elapsed = time.monotonic() - t0
        st = eng.stats()
    assert c.server == b.addr and 0.3 <= elapsed < 3
    assert st["timeouts"] == 1 and st["retries"] == 1


async def test_all_servers_failing_give_one_clear_error_after_budget(fakes):
    a, b = await fakes(2)
    a.always = b.always = "500"
    # unhealthy_after high so that the retry budget, not the health check, ends it
    async with SGLangClient([a.addr, b.addr], cfg(request_retries=3), unhealthy_after=10) as eng:
        with pytest.raises(GenerationError) as ei:
            await eng.agenerate(req())
    msg = str(ei.value)
    assert "after 3 retries" in msg and "HTTP 500" in msg and "CUDA out of memory" in msg
    assert a.addr in msg and b.addr in msg
    assert len(a.generate_payloads) + len(b.generate_payloads) == 4


async def test_backoff_doubles(fakes):
    (a,) = await fakes(1)
    a.actions = ["500", "500", "500"]
    async with SGLangClient([a.addr], cfg(retry_backoff_s=0.1), unhealthy_after=10) as eng:
        t0 = time.monotonic()
        await eng.agenerate(req())
    assert time.monotonic() - t0 >= 0.1 + 0.2 + 0.4 - 0.02


async def test_4xx_is_raised_at_once_with_the_server_message(fakes):
    a, b = await fakes(2)
    a.always = b.always = "400"
    async with SGLangClient([a.addr, b.addr], cfg()) as eng:
        with pytest.raises(BadRequestError) as ei:
            await eng.agenerate(req())
        assert eng.stats()["retries"] == 0
    assert ei.value.status == 400 and "Unknown sampling parameter 'foo'" in str(ei.value)
    assert len(a.generate_payloads) + len(b.generate_payloads) == 1


async def test_429_is_retried_and_an_unexpected_status_is_not(fakes):
    """408 and 429 say the server is busy: another attempt may pass. Any other non-200 that
    is not a 5xx (a redirect, say) is reported at once, not retried."""
    (a,) = await fakes(1)
    a.actions = ["429"]
    async with SGLangClient([a.addr], cfg(), unhealthy_after=10) as eng:
        out = await eng.agenerate(req())
        assert len(out.output_ids) == 8 and eng.stats()["retries"] == 1 and eng.stats()["http_5xx"] == 1
        a.actions = ["302"]
        with pytest.raises(BadRequestError) as ei:
            await eng.agenerate(req())
        assert ei.value.status == 302 and eng.stats()["retries"] == 1


async def test_dead_server_leaves_rotation_and_probe_brings_it_back(fakes):
    a, b = await fakes(2)
    port_a = a.port
    await a.stop()  # connection refused from now on
    async with SGLangClient([a.addr, b.addr], cfg(), unhealthy_after=2,
                                  health_probe_interval_s=0.2) as eng:
        comps = await asyncio.gather(*(eng.agenerate(req()) for _ in range(8)))
        assert all(c.server == b.addr for c in comps)
        assert eng.healthy_servers == [b.addr]
        st = eng.stats()
        assert st["connection_errors"] >= 2 and st["marked_unhealthy"] == 1 and st["failed"] == 0
        await a.start(port=port_a)
        await asyncio.sleep(0.25)
        await eng.agenerate(req())  # routing notices the probe is due
        for _ in range(50):
            if a.addr in eng.healthy_servers:
                break
            await asyncio.sleep(0.02)
        assert eng.healthy_servers == [a.addr, b.addr] and eng.stats()["recovered"] == 1


async def test_mark_unhealthy_moves_inflight_requests(fakes):
    a, b = await fakes(2)
    a.always = "hang"
    async with SGLangClient([a.addr, b.addr], cfg(request_timeout_s=30)) as eng:
        task = asyncio.create_task(eng.agenerate(req()))
        while not a.generate_payloads:
            await asyncio.sleep(0.01)
        eng.mark_unhealthy(a.addr, "operator said so")
        c = await asyncio.wait_for(task, 3)
        st = eng.stats()
    assert c.server == b.addr and st["evicted"] == 1 and st["retries"] == 1
    assert st["servers"][a.addr]["reason"] == "operator said so"


async def test_caller_cancellation_is_not_swallowed(fakes):
    (a,) = await fakes(1)
    a.always = "hang"
    async with SGLangClient([a.addr], cfg(request_timeout_s=30)) as eng:
        task = asyncio.create_task(eng.agenerate(req()))
        while not a.generate_payloads:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert eng.stats()["servers"][a.addr]["inflight"] == 0


async def test_no_healthy_server_is_a_clear_error(fakes):
    (a,) = await fakes(1)
    await a.stop()
    async with SGLangClient([a.addr], cfg(request_retries=5), unhealthy_after=1) as eng:
        with pytest.raises(NoHealthyServerError) as ei:
            await eng.agenerate(req())
    assert "no healthy inference server" in str(ei.value) and a.addr in str(ei.value)


# ------------------------------------------------------- interruptions


async def test_abort_resume_is_seamless_with_two_versions(fakes):
    (f,) = await fakes(1, token_delay=0.005)
    async with SGLangClient([f.addr], cfg()) as eng:
        task = asyncio.create_task(eng.agenerate(req(n_prompt=4, max_new=40)))
        await asyncio.sleep(0.06)  # some tokens are out
        await eng.pause_generation()  # the weight update begins: in-flight request aborts
        while not eng.stats()["aborts"]:
            await asyncio.sleep(0.01)
        await eng.update_weight_version(1)
        assert len(f.generate_payloads) == 1  # the client holds the resubmission until continue
        await eng.continue_generation()
        c = await asyncio.wait_for(task, 5)
    k = c.output_versions.count(0)
    assert 0 < k < 40 and c.output_versions == [0] * k + [1] * (40 - k)
    assert c.output_ids == [tok(4 + i) for i in range(40)]  # same as uninterrupted
    assert c.output_logprobs == pytest.approx([-0.01 * (4 + i) for i in range(40)])
    assert c.n_interruptions == 1 and c.finish_reason == "length" and c.input_ids == list(range(10, 14))
    second = f.generate_payloads[1]
    assert second["input_ids"] == list(range(10, 14)) + c.output_ids[:k]
    assert second["sampling_params"]["max_new_tokens"] == 40 - k
    assert second["rid"] != f.generate_payloads[0]["rid"]


async def test_abort_ending_on_eos_is_finished(fakes):
    (f,) = await fakes(1)
    f.actions = ["abort_eos"]
    async with SGLangClient([f.addr], cfg(), eos_token_ids=[EOS]) as eng:
        c = await eng.agenerate(req(max_new=10))
    assert c.finish_reason == "stop" and c.output_ids == [tok(5), EOS] and len(f.generate_payloads) == 1


@pytest.mark.parametrize("ignore_eos,resumed", [(False, False), (True, True)])
async def test_abort_ending_on_a_stop_token_follows_sglang(fakes, ignore_eos, resumed):
    # SGLang checks stop_token_ids only without ignore_eos (Req.check_finished), so an
    # uninterrupted generation with ignore_eos runs on past a stop token: so does a resumed one.
    (f,) = await fakes(1)
    f.actions = ["abort_eos"]
    async with SGLangClient([f.addr], cfg()) as eng:
        r = req(max_new=10)
        r.sampling = r.sampling.replace(stop_token_ids=[EOS], ignore_eos=ignore_eos)
        c = await eng.agenerate(r)
    assert len(f.generate_payloads) == (2 if resumed else 1)
    assert c.output_ids[:2] == [tok(5), EOS] and c.n_interruptions == 1
    assert (c.finish_reason, len(c.output_ids)) == (("length", 10) if resumed else ("stop", 2))


async def test_empty_abort_retries_without_spending_retry_budget(fakes):
    (f,) = await fakes(1)
    f.actions = ["abort0", "abort0"]
    async with SGLangClient([f.addr], cfg(request_retries=0)) as eng:
        c = await eng.agenerate(req(max_new=4))
        st = eng.stats()
    assert c.output_ids == [tok(5 + i) for i in range(4)] and c.n_interruptions == 2
    assert st["retries"] == 0 and st["empty_aborts"] == 2


async def test_a_request_our_pause_drops_from_the_queue_waits_at_the_gate(fakes, monkeypatch):
    # SGLang's abort mode drops waiting requests too: with no token out, that is not a stuck
    # server (the empty-abort limit, here 0) and needs no backoff: it goes again on resume.
    from arealite.inference_client import remote_client

    monkeypatch.setattr(remote_client, "_MAX_EMPTY_ABORTS", 0)
    (f,) = await fakes(1)
    f.actions = ["queued"]
    async with SGLangClient([f.addr], cfg()) as eng:
        task = asyncio.create_task(eng.agenerate(req(max_new=4)))
        while not f.generate_payloads:
            await asyncio.sleep(0.005)
        eng.pause()
        await eng.pause_generation()
        while not eng.stats()["empty_aborts"]:
            await asyncio.sleep(0.005)
        await eng.continue_generation()
        await asyncio.sleep(0.05)
        assert not task.done() and len(f.generate_payloads) == 1  # held by the client's gate
        t0 = time.monotonic()
        eng.resume()
        c = await asyncio.wait_for(task, 3)
        assert time.monotonic() - t0 < 0.5
    assert c.output_ids == [tok(5 + i) for i in range(4)] and c.n_interruptions == 1


async def test_client_pause_gate_holds_submissions(fakes):
    (f,) = await fakes(1)
    async with SGLangClient([f.addr], cfg()) as eng:
        eng.pause()
        assert eng.paused
        task = asyncio.create_task(eng.agenerate(req()))
        await asyncio.sleep(0.1)
        assert not task.done() and f.generate_payloads == []
        eng.resume()
        c = await asyncio.wait_for(task, 3)
    assert len(c.output_ids) == 8


async def test_client_holds_requests_during_its_pause_beyond_the_request_timeout(fakes):
    (f,) = await fakes(1, token_delay=0.005)
    # A weight update (0.8 s) longer than the request timeout (0.3 s) is no fault.
    async with SGLangClient([f.addr], cfg(request_timeout_s=0.3), unhealthy_after=1) as eng:
        running = asyncio.create_task(eng.agenerate(req(max_new=30)))
        await asyncio.sleep(0.05)
        await eng.pause_generation()
        new = asyncio.create_task(eng.agenerate(req(max_new=4)))
        await asyncio.sleep(0.8)
        assert len(f.generate_payloads) == 1, "nothing is sent to a server this client paused"
        assert eng.stats()["aborts"] == 1 and not running.done() and not new.done()
        await eng.continue_generation()
        c, c_new = await asyncio.wait_for(asyncio.gather(running, new), 3)
        st = eng.stats()
    assert c.n_interruptions == 1 and c.output_ids == [tok(5 + i) for i in range(30)]
    assert c_new.n_interruptions == 0 and len(c_new.output_ids) == 4
    assert st["timeouts"] == st["retries"] == st["failed"] == 0 and eng.healthy_servers == [f.addr]


async def test_pause_without_continue_fails_requests_after_max_pause_s(fakes):
    (f,) = await fakes(1)
    async with SGLangClient([f.addr], cfg(), max_pause_s=0.3) as eng:
        await eng.pause_generation()  # ... and the weight update dies before continue
        t0 = time.monotonic()
        with pytest.raises(GenerationError) as ei:
            await eng.agenerate(req())
        assert 0.25 <= time.monotonic() - t0 < 2
        assert f.addr in str(ei.value) and "max_pause_s=0.3" in str(ei.value)
        assert f.generate_payloads == [] and eng.stats()["failed"] == 1
        await eng.continue_generation()
        assert len((await eng.agenerate(req())).output_ids) == 8
    with pytest.raises(ValueError, match="max_pause_s"):
        SGLangClient([f.addr], max_pause_s=0)


# ---------------------------------------------------- routing and limits


async def test_affinity_keeps_a_group_on_one_server_and_moves_when_it_dies(fakes):
    servers = await fakes(3)
    addrs = [s.addr for s in servers]
    async with SGLangClient(addrs, cfg()) as eng:
        groups = {g: [] for g in range(6)}
        comps = await asyncio.gather(*(eng.agenerate(req(affinity_key=f"g{g}"))
                                       for g in groups for _ in range(4)))
        for i, c in enumerate(comps):
            groups[i // 4].append(c.server)
        assert all(len(set(v)) == 1 for v in groups.values())
        assert len({v[0] for v in groups.values()}) == 3  # groups spread over servers
        owner = groups[0][0]
        eng.mark_unhealthy(owner, "test")
        moved = [await eng.agenerate(req(affinity_key="g0")) for _ in range(3)]
        assert len({c.server for c in moved}) == 1 and moved[0].server != owner


@pytest.mark.parametrize("how", ["marked_unhealthy", "timeouts"])
async def test_requests_queued_for_a_server_that_leaves_move_at_once(fakes, how):
    a, b = await fakes(2)
    a.always = "hang"
    timeout = 30.0 if how == "marked_unhealthy" else 1.0
    async with SGLangClient([a.addr, b.addr], cfg(request_timeout_s=timeout, max_inflight_per_server=1),
                                  unhealthy_after=1) as eng:
        t0 = time.monotonic()
        # One group: all three go to a (round-robin starts there), two wait for its only slot.
        tasks = [asyncio.create_task(eng.agenerate(req(affinity_key="g"))) for _ in range(3)]
        while not a.generate_payloads:
            await asyncio.sleep(0.01)
        if how == "marked_unhealthy":
            eng.mark_unhealthy(a.addr, "operator said so")
        comps = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        elapsed = time.monotonic() - t0
        st = eng.stats()
    assert all(c.server == b.addr and len(c.output_ids) == 8 for c in comps)
    assert len(a.generate_payloads) == 1, "only the request in flight reached the server that left"
    # Marked: well below one timeout. Timed out: the one in flight waits its timeout, no one else.
    assert elapsed < (3.0 if how == "marked_unhealthy" else 1.8 * timeout)
    assert st["retries"] == 1 and st["failed"] == 0  # the queued ones spent no retry


async def test_inflight_bound_per_server(fakes):
    (f,) = await fakes(1, token_delay=0.002)
    async with SGLangClient([f.addr], cfg(max_inflight_per_server=3)) as eng:
        comps = await asyncio.gather(*(eng.agenerate(req(max_new=10)) for _ in range(20)))
    assert len(comps) == 20 and f.max_inflight == 3


@pytest.mark.parametrize("reported,bound", [(2, 4), (None, 10), (50, 10), (True, 10), ("8", 10)])
async def test_inflight_bound_follows_the_servers_own_batch(fakes, reported, bound):
    # Twice what the server runs at once (a batch running, one waiting): a weight update
    # aborts whatever waits in its queue. Nothing or nonsense reported: the configured bound.
    (f,) = await fakes(1, token_delay=0.002)
    f.max_running_requests = reported
    async with SGLangClient([f.addr], cfg(max_inflight_per_server=10)) as eng:
        await eng.initialize(timeout=5)
        comps = await asyncio.gather(*(eng.agenerate(req(max_new=10)) for _ in range(30)))
    assert len(comps) == 30 and f.max_inflight == bound


# ---------------------------------------------------- start-up, key, versions


async def test_initialize_timeout_names_the_silent_server(fakes):
    (a,) = await fakes(1)
    dead = f"127.0.0.1:{free_port()}"
    async with SGLangClient([a.addr, dead], cfg()) as eng:
        t0 = time.monotonic()
        with pytest.raises(ServerStartupError) as ei:
            await eng.initialize(timeout=0.5)
        assert 0.5 <= time.monotonic() - t0 < 3
    msg = str(ei.value)
    assert dead in msg and a.addr not in msg and "1 of 2" in msg


async def test_api_key_sent_everywhere_and_never_shown(fakes):
    key = "sk-secret-123"
    a, b = await fakes(2, api_key=key)
    a.actions = ["500"]
    async with SGLangClient([a.addr, b.addr], cfg(request_retries=0), api_key=key) as eng:
        await eng.initialize(timeout=5)
        with pytest.raises(GenerationError) as ei:
            await eng.agenerate(req())
        await eng.agenerate(req())
        await eng.flush_cache()
        assert key not in repr(eng) and key not in str(eng.stats())
    assert key not in str(ei.value)
    assert a.auth_headers and all(h == f"Bearer {key}" for h in a.auth_headers + b.auth_headers)
    # a wrong key is a 401: raised at once, naming the route
    async with SGLangClient([b.addr], cfg(), api_key="wrong") as eng:
        with pytest.raises(BadRequestError, match="401"):
            await eng.agenerate(req())


@pytest.mark.parametrize("text,expected", [
    ("0.5.23", (0, 5, 23, 0)), ("0.5.21rc1", (0, 5, 21, -1)), ("0.5.3.post1", (0, 5, 3, 1)),
    ("v0.4", (0, 4, 0, 0)), ("0.5.21.dev0+g1234", (0, 5, 21, -1)), ("nonsense", None), (None, None),
])
def test_parse_sglang_version(text, expected):
    assert parse_sglang_version(text) == expected


async def test_begin_end_weight_update_only_on_new_releases(fakes):
    new, old, rc = await fakes(1, version="0.5.23") + await fakes(1, version="0.5.3.post1") \
        + await fakes(1, version="0.5.21rc1")
    async with SGLangClient([new.addr, old.addr, rc.addr], cfg()) as eng:
        await eng.initialize(timeout=5)
        assert eng.server_version(old.addr) == "0.5.3.post1"
        out = await eng.begin_weight_update()
        await eng.end_weight_update()
    assert set(out) == {new.addr}
    assert [r for r, _ in new.calls] == ["/begin_weight_update", "/end_weight_update"]
    assert old.calls == [] and rc.calls == []


# ---------------------------------------------------------------- admin


async def test_admin_failure_names_the_server(fakes):
    a, b = await fakes(2)
    b.admin_fail["/update_weights_from_disk"] = "file not found: /nope"
    async with SGLangClient([a.addr, b.addr], cfg()) as eng:
        with pytest.raises(ServerAdminError) as ei:
            await eng.update_weights_from_disk("/nope", version=3)
    err = ei.value
    assert list(err.failures) == [b.addr] and "file not found" in str(err) and a.addr in err.results
    assert a.calls == [("/update_weights_from_disk", {"model_path": "/nope", "weight_version": "3", "flush_cache": True})]


async def test_admin_calls_reuse_one_keep_alive_connection_and_name_a_dead_server(fakes):
    # Admin POSTs go over the admin thread's own HTTP/1.1 pool per server: one connection for
    # every call, none of the generation path's, the api key sent, a server that stopped
    # answering named with its connection error.
    a, b = await fakes(2, api_key="k")
    async with SGLangClient([a.addr, b.addr], cfg(), api_key="k") as eng:
        await eng.initialize(timeout=5)
        for _ in range(3):
            await eng.admin.pause_generation()
            await eng.admin.continue_generation()
        assert eng.pool.admin_calls.control.connection_stats()[a.addr] == {"idle": 1, "live": 1}
        assert eng.pool.get(a.addr).conns.stats() == {"idle": 0, "live": 0}
        assert [r for r, _ in a.calls] == ["/pause_generation", "/continue_generation"] * 3
        assert a.auth_headers[-1] == "Bearer k"
        await b.stop()
        with pytest.raises(ServerAdminError, match=b.addr) as ei:
            await eng.admin.pause_generation()
        assert "cannot connect" in str(ei.value) and a.addr in ei.value.results


async def test_answers_aborted_by_a_pause_are_parsed_after_its_fan_out_even_a_failed_one(fakes):
    a = (await fakes(1))[0]
    async with SGLangClient([a.addr], cfg()) as eng:
        await eng.initialize(timeout=5)
        seen = []

        async def fan_out():
            seen.append(eng.pool.pause_sent.is_set())
            raise RuntimeError("a server did not answer")

        with pytest.raises(RuntimeError):
            await eng.pool.pausing(fan_out())
        assert seen == [False] and eng.pool.pause_sent.is_set()


async def test_weight_group_rank_offsets_follow_tp_size(fakes):
    a = (await fakes(1, tp_size=2))[0]
    b = (await fakes(1, tp_size=None))[0]  # no tp_size reported -> 1 rank
    async with SGLangClient([a.addr, b.addr], cfg()) as eng:
        await eng.initialize(timeout=5)
        assert eng.weights_update_world_size() == 4
        with pytest.raises(ValueError, match="world_size=4"):
            await eng.init_weights_update_group("127.0.0.1", 1234, world_size=3, group_name="g")
        await eng.init_weights_update_group("127.0.0.1", 1234, group_name="g", backend="gloo")
        await eng.update_weights_from_distributed(["w"], ["torch.float32"], [(2, 3)], group_name="g",
                                                  version=5)
        assert eng.get_version() == 5
        got = await eng.get_weights_by_name("w", truncate_size=1)
        await eng.destroy_weights_update_group("g")
        with pytest.raises(ValueError, match="unknown weight-update group"):
            await eng.update_weights_from_distributed([], [], [], group_name="g")
    assert got == {a.addr: [0.5], b.addr: [0.5]}
    init_a, init_b = a.calls[0][1], b.calls[0][1]
    assert (init_a["rank_offset"], init_b["rank_offset"]) == (1, 3)
    assert init_a["world_size"] == init_b["world_size"] == 4 and init_a["group_name"] == "g"
    upd = a.calls[1][1]
    assert upd["dtypes"] == ["float32"] and upd["shapes"] == [[2, 3]] and upd["weight_version"] == "5"


async def test_group_with_a_dead_member_fails_instead_of_hanging(fakes):
    a, b = await fakes(2)
    async with SGLangClient([a.addr, b.addr], cfg()) as eng:
        await eng.init_weights_update_group("127.0.0.1", 1234)
        eng.mark_unhealthy(b.addr, "crashed")
        with pytest.raises(ServerAdminError, match=b.addr):
            await eng.update_weights_from_distributed(["w"], ["float32"], [[1]])


async def test_server_missing_a_weight_update_stays_out(fakes):
    a, b = await fakes(2)
    async with SGLangClient([a.addr, b.addr], cfg(), health_probe_interval_s=0.0) as eng:
        eng.mark_unhealthy(b.addr, "flaky")
        await eng.update_weights_from_disk("/ckpt", version=1)
        for _ in range(3):
            await eng.agenerate(req())
            await asyncio.sleep(0.02)
        assert eng.healthy_servers == [a.addr]
        assert "version 1" in eng.stats()["servers"][b.addr]["excluded"]


async def test_aclose_leaves_no_unclosed_session_warning(fakes):
    (a,) = await fakes(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eng = SGLangClient([a.addr], cfg())
        await eng.agenerate(req())
        await eng.aclose()
        del eng
        gc.collect()
        await asyncio.sleep(0)
    assert not [w for w in caught if "Unclosed" in str(w.message)]


# ------------------------------------------------- a group's requests in one exchange


async def test_a_groups_requests_leave_as_one_batched_generate(fakes):
    (f,) = await fakes(1)
    async with SGLangClient([f.addr], cfg()) as eng:
        reqs = [req(n_prompt=5 + i, max_new=4 + i, affinity_key="g") for i in range(4)]
        comps = await asyncio.gather(*(eng.agenerate(r) for r in reqs))
        lone = await eng.agenerate(req(affinity_key="h"))
        st = eng.stats()
    assert len(f.generate_bodies) == 2
    body = f.generate_bodies[0]
    assert body["rid"] == [r.rid for r in reqs]
    assert body["input_ids"] == [r.input_ids for r in reqs] and body["return_logprob"] is True
    assert [sp["max_new_tokens"] for sp in body["sampling_params"]] == [4, 5, 6, 7]
    assert isinstance(f.generate_bodies[1]["input_ids"][0], int), "a request alone goes in the plain form"
    for r, c in zip(reqs, comps):  # each member got its own part, in order
        n = len(r.input_ids)
        assert c.rid == r.rid and c.output_ids == [tok(n + i) for i in range(r.sampling.max_new_tokens)]
        assert c.output_logprobs == pytest.approx([-0.01 * (n + i) for i in range(r.sampling.max_new_tokens)])
    assert lone.output_ids and st["batches"] == 1 and st["batched_requests"] == 4 and st["completed"] == 5


async def test_batching_can_be_turned_off(fakes):
    (f,) = await fakes(1)
    async with SGLangClient([f.addr], cfg(batch_requests=False)) as eng:
        await asyncio.gather(*(eng.agenerate(req(affinity_key="g")) for _ in range(3)))
    assert len(f.generate_bodies) == 3 and all(isinstance(b["rid"], str) for b in f.generate_bodies)


async def test_a_batch_refused_with_400_is_resent_one_by_one_and_only_the_culprit_fails(fakes):
    (f,) = await fakes(1)
    # The batch's four items: the last is refused, so SGLang refuses the whole request. Sent
    # again alone, the opener's is refused once more and the three others go through.
    f.actions = [None, None, None, "400", "400"]
    async with SGLangClient([f.addr], cfg()) as eng:
        out = await asyncio.gather(*(eng.agenerate(req(affinity_key="g")) for _ in range(4)),
                                   return_exceptions=True)
        st = eng.stats()
    assert isinstance(out[0], BadRequestError) and "Unknown sampling parameter" in str(out[0])
    assert all(len(c.output_ids) == 8 for c in out[1:])
    assert len(f.generate_bodies) == 5 and st["batches_split"] == 1
    assert st["bad_requests"] == 1 and st["retries"] == 0


async def test_a_failed_batch_is_a_failed_attempt_of_each_member(fakes):
    (f,) = await fakes(1)
    f.actions = ["500"] * 3  # the batch of three fails once; the retries pass
    async with SGLangClient([f.addr], cfg(), unhealthy_after=2) as eng:
        comps = await asyncio.gather(*(eng.agenerate(req(affinity_key="g")) for _ in range(3)))
        st = eng.stats()
    assert all(len(c.output_ids) == 8 for c in comps)
    assert st["retries"] == 3 and st["http_5xx"] == 3 and st["failed"] == 0
    assert st["marked_unhealthy"] == 0, "one failed exchange counts once against the server"
    assert len(f.generate_bodies[0]["rid"]) == 3 and len(f.generate_payloads) == 6


async def test_a_member_cancelled_by_its_caller_leaves_the_others_alone(fakes):
    (f,) = await fakes(1, token_delay=0.01)
    async with SGLangClient([f.addr], cfg()) as eng:
        tasks = [asyncio.create_task(eng.agenerate(req(affinity_key="g"))) for _ in range(3)]
        while not f.generate_bodies:
            await asyncio.sleep(0.005)
        tasks[0].cancel()  # the opener, which sends the batch
        tasks[2].cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(done[0], asyncio.CancelledError) and isinstance(done[2], asyncio.CancelledError)
    assert len(done[1].output_ids) == 8, "the member left waiting sends its request itself"


async def test_an_aborted_batch_resumes_each_member_from_its_own_tokens(fakes):
    (f,) = await fakes(1, token_delay=0.01)
    async with SGLangClient([f.addr], cfg()) as eng:
        tasks = [asyncio.create_task(eng.agenerate(req(n_prompt=5 + i, max_new=20, affinity_key="g")))
                 for i in range(3)]
        while f.inflight < 3:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        await eng.pause_generation()
        await asyncio.sleep(0.05)
        await eng.continue_generation()
        comps = await asyncio.gather(*tasks)
    for i, c in enumerate(comps):  # seamless across the abort: the same tokens as one run
        assert c.output_ids == [tok(5 + i + j) for j in range(20)] and c.n_interruptions == 1
    assert len(f.generate_bodies) == 2 and len(f.generate_bodies[1]["rid"]) == 3, "resumed as one batch again"


async def test_a_server_that_refuses_the_batch_form_gets_requests_one_at_a_time(fakes):
    (f,) = await fakes(1)
    f.refuse_batches = True  # as sglang-router, which refuses a list of rids
    async with SGLangClient([f.addr], cfg()) as eng:
        first = await asyncio.gather(*(eng.agenerate(req(affinity_key="g")) for _ in range(3)))
        later = await asyncio.gather(*(eng.agenerate(req(affinity_key="h")) for _ in range(3)))
        st = eng.stats()
    assert all(len(c.output_ids) == 8 for c in first + later) and st["bad_requests"] == 0
    assert len(f.generate_bodies) == 1 + 3 + 3 and st["batches"] == 1 and st["batches_split"] == 1
    assert all(isinstance(b["rid"], str) for b in f.generate_bodies[1:])


async def test_a_batch_answered_with_too_few_entries_is_malformed_for_each_member(fakes):
    (f,) = await fakes(1)
    f.actions = ["short"]
    async with SGLangClient([f.addr], cfg(), unhealthy_after=2) as eng:
        comps = await asyncio.gather(*(eng.agenerate(req(affinity_key="g")) for _ in range(3)))
        st = eng.stats()
    assert all(len(c.output_ids) == 8 for c in comps)
    assert st["malformed"] == 3 and st["retries"] == 3 and st["marked_unhealthy"] == 0, \
        "one bad exchange counts once against the server, not once per member"
