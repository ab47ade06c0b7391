"""Chat ``image_url`` parts at the OpenAI-compatible endpoint: data URLs flow into the request's
``image_data`` (the prompt expanded by the model's processor) and into the trajectory rows
(``pixel_values`` / ``image_grid_thw``); bad data URLs and remote URLs are 400s naming the part."""

from __future__ import annotations

import base64
import io

import aiohttp
import pytest
import torch

from arealite.agent.endpoint import AgentEndpoint
from arealite.agent.trajectory import episode_rows
from arealite.api.types import Completion
from arealite.config.agent import AgentConfig
from arealite.config.schema import GenerationConfig
from arealite.models.tiny import build_tiny_model
from arealite.vision.processor import load_processor


def png(w: int, h: int, color=(255, 0, 0)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="PNG")
    return buf.getvalue()


def data_url(b: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(b).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    return load_processor(build_tiny_model(tmp_path_factory.mktemp("vl") / "vl-micro", size="vl-micro", seed=0))


class Recording:
    """A policy that answers "ok" + end of turn and keeps every request."""

    def __init__(self, tok):
        self.tok, self.requests = tok, []
        self.eot = tok.convert_tokens_to_ids("<|im_end|>")

    async def agenerate(self, req):
        self.requests.append(req)
        out = self.tok.encode("ok", add_special_tokens=False) + [self.eot]
        return Completion(req.rid, list(req.input_ids), out, [-0.1] * len(out), [3] * len(out), "stop")


@pytest.fixture
async def endpoint(processor):
    ep = await AgentEndpoint(processor.tokenizer, GenerationConfig(max_new_tokens=8), AgentConfig(),
                             processor=processor).start()
    try:
        yield ep
    finally:
        await ep.aclose()


async def post(ep, s, messages) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.post(ep.base_url(s) + "/chat/completions",
                                                          json={"model": "m", "messages": messages}) as r:
        return r.status, await r.json()


async def test_image_parts_flow_into_image_data_and_the_trajectory(endpoint, processor):
    client = Recording(processor.tokenizer)
    s = endpoint.open_session(client, "k")
    a, b = png(28, 28), png(56, 28, (0, 0, 255))
    msgs = [{"role": "user", "content": [{"type": "text", "text": "compare"}, image_part(data_url(a)),
                                         image_part(data_url(b))]}]
    status, body = await post(endpoint, s, msgs)
    assert status == 200, body
    (req,) = client.requests
    assert req.image_data == [base64.b64encode(a).decode(), base64.b64encode(b).decode()]
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    grid = s.calls[0].vision.image_grid_thw
    from PIL import Image

    pil = [Image.open(io.BytesIO(x)).convert("RGB") for x in (a, b)]
    assert torch.equal(grid, processor.image_processor(pil, return_tensors="pt")["image_grid_thw"])
    n_patches = int(grid.prod(dim=1).sum())
    assert req.input_ids.count(pad) == n_patches // 4  # one pad per merged 2x2 patch

    # The next turn continues the first token-exactly and keeps its images.
    msgs += [body["choices"][0]["message"], {"role": "user", "content": "and now?"}]
    status, _ = await post(endpoint, s, msgs)
    assert status == 200
    second = client.requests[1]
    assert second.image_data == req.image_data and second.input_ids[: len(req.input_ids)] == req.input_ids
    ((row, _, _),) = episode_rows(s.calls, "conversation")
    assert row["pixel_values"].shape == (1, n_patches, s.calls[0].vision.pixel_values.shape[1])
    assert torch.equal(row["image_grid_thw"][0], grid)

    # Another image in a later turn: rendered afresh, not continued (no sharing across images).
    msgs += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": [image_part(data_url(a))]}]
    status, _ = await post(endpoint, s, msgs)
    assert status == 200 and len(client.requests[2].image_data) == 3 and s.calls[2].parent is None
    endpoint.close_session(s)


@pytest.mark.parametrize("url, match", [
    ("data:image/png;base64,@@@", "base64"),
    ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "not a decodable image"),
    ("https://example.com/cat.png", "remote image URLs are refused"),
    ("file:///etc/passwd", "must be a data: URL"),
])
async def test_bad_image_parts_are_400s_naming_the_part(endpoint, processor, url, match):
    client = Recording(processor.tokenizer)
    s = endpoint.open_session(client, "k")
    status, body = await post(endpoint, s, [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                                         image_part(url)]}])
    assert status == 400 and match in body["error"]["message"], body
    assert body["error"]["param"] == "messages[0].content[1].image_url.url"
    assert not client.requests
    endpoint.close_session(s)


async def test_a_text_only_endpoint_refuses_image_parts(processor):
    ep = await AgentEndpoint(processor.tokenizer, GenerationConfig(max_new_tokens=8), AgentConfig()).start()
    try:
        client = Recording(processor.tokenizer)
        s = ep.open_session(client, "k")
        status, body = await post(ep, s, [{"role": "user", "content": [image_part(data_url(png(28, 28)))]}])
        assert status == 400 and "vision-language policy" in body["error"]["message"]
        assert not client.requests
    finally:
        await ep.aclose()
