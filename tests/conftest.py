"""Shared test setup: uvloop as the event loop, the tiny model, gpu skipping.

All async tests share one session-scoped uvloop loop (set in pyproject.toml):
one consistent scope, because a fixture and a test on different loops hang
rather than fail.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import uvloop

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

REPO = Path(__file__).resolve().parents[1]


def pytest_asyncio_loop_factories(config, item):
    return {"uvloop": uvloop.new_event_loop}


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A ~1M-parameter Qwen2-style HF model directory, built offline once per session."""
    from arealite.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_small"), size="small", seed=0)


@pytest.fixture(scope="session")
def micro_model_dir(tmp_path_factory) -> Path:
    """A ~0.1M-parameter model for the fastest tests."""
    from arealite.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_micro"), size="micro", seed=0)


@pytest.fixture(scope="session")
def one_rank_results(micro_model_dir, tmp_path_factory) -> dict:
    """The scenario of tests/_fsdp_worker.py in this process (a world of one): what every
    parallel layout of it is compared with."""
    import torch
    from fsdp_scenario import load_worker

    out = tmp_path_factory.mktemp("fsdp_1rank")
    load_worker().run(str(micro_model_dir), str(out))
    return torch.load(out / "result_rank0.pt", weights_only=False)


def run_env(*paths: str | Path, **extra: str) -> dict[str, str]:
    """The environment of an end-to-end child run: one thread per op, offline, the checkout
    (and `paths` before it) on PYTHONPATH, embedded servers as strict as SGLang
    (`arealite.server.strict`), plus `extra`."""
    env = dict(os.environ)
    path = [*map(str, paths), str(REPO), env.get("PYTHONPATH", "")]
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(path), AREALITE_STRICT_SGLANG="1", SGLANG_HEALTH_CHECK_TIMEOUT="5",
               **extra)
    return env


def stop_process(proc: subprocess.Popen, timeout: float = 15) -> None:
    """Terminate ``proc``; kill it if it has not exited within ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def base_state(micro_model_dir):
    """The micro model's state dict, as the trainer would hold it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(micro_model_dir))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def perturbed_weights(base: dict, seed: int) -> dict:
    """Different weights of the same shapes (a new policy version), tied embedding kept tied."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()
           if k != "lm_head.weight"}
    if "lm_head.weight" in base:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


@pytest.fixture(scope="session")
def micro_demo_dir(tmp_path_factory) -> Path:
    """A small reverse-digits demo (model, 64 training and 8 held-out prompts) for end-to-end runs."""
    out = tmp_path_factory.mktemp("demo")
    subprocess.run(
        [sys.executable, "examples/reverse_digits/prepare.py", "--out", str(out), "--size", "micro",
         "--n-train", "64", "--n-eval", "8", "--warmup-steps", "5", "--batch-size", "8"],
        cwd=REPO, env=run_env(), check=True, timeout=300, capture_output=True)
    return out


@pytest.fixture(scope="module")
def loop_runner():
    """An event loop on a thread of its own; the fixture runs a coroutine on it and returns its
    result (at most 120 s): the way a trainer drives the async client."""
    import asyncio
    import threading

    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    yield lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(120)
    loop.call_soon_threadsafe(loop.stop)
    t.join(5)


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir):
    """One embedded server on the tiny model (seed 0) for the tests of a module."""
    from arealite.server.process import ServerProcess

    proc = ServerProcess(tiny_model_dir, free_port(), threads=1, extra_args=["--random-seed", "0"])
    try:
        yield proc.wait_healthy(120)
    finally:
        proc.stop()


class ScriptedChat:
    """An inference client whose model answers request k with ``texts[k % len]`` and the chat
    template's end-of-turn token (``<|im_end|>``); ``prompts`` records each request's input ids."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.prompts = tok, texts, []
        self.eot = tok.convert_tokens_to_ids("<|im_end|>")

    async def agenerate(self, req):
        from arealite.api.types import Completion

        k = len(self.prompts)
        self.prompts.append(list(req.input_ids))
        out = self.tok.encode(self.texts[k % len(self.texts)], add_special_tokens=False) + [self.eot]
        return Completion(req.rid, list(req.input_ids), out, [-0.1] * len(out), [3] * len(out), "stop")


class RecordingClient:
    """A real inference client that records every request's input ids and its completion."""

    def __init__(self, client):
        self.client, self.calls = client, []

    async def initialize(self, timeout=300.0):
        await self.client.initialize(timeout)

    async def agenerate(self, req):
        c = await self.client.agenerate(req)
        self.calls.append((list(req.input_ids), c))
        return c

    async def aclose(self):
        await self.client.aclose()


class RolloutOf:
    """A client and its started controller as the publisher sees a rollout side
    (`WeightUpdateTarget`): the client's admin, the controller's loop; the controller is
    paused around an update, and both get the version."""

    def __init__(self, client, controller):
        self.client, self.controller = client, controller

    @property
    def admin(self):
        return self.client.admin

    @property
    def run(self):
        return self.controller.run

    def pause(self) -> None:
        self.controller.pause()

    def resume(self) -> None:
        self.controller.resume()

    def set_version(self, version: int) -> None:
        self.controller.set_version(version)
        self.client.set_version(version)
