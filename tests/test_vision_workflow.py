"""Workflows with images: what the requests carry and what the trajectories hold (docs/vision.md)."""

from __future__ import annotations

import base64
import io

import pytest
import torch

from arealite.api.types import Completion
from arealite.config.schema import GenerationConfig
from arealite.models.tiny import IMAGE_PAD, VISION_START, build_tiny_model
from arealite.vision.image_io import to_png_bytes
from arealite.vision.processor import image_token_counter, load_processor
from arealite.workflow.base import concat_trajectories, pad_and_stack
from arealite.workflow.multi_turn import MultiTurnWorkflow
from arealite.workflow.rlvr import RLVRWorkflow
from tests.test_client import fakes  # noqa: F401  (the fake SGLang servers fixture)


def png(w: int, h: int, color=(255, 0, 0)) -> bytes:
    from PIL import Image

    return to_png_bytes(Image.new("RGB", (w, h), color))


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("vlw") / "vl", size="vl-micro")


@pytest.fixture(scope="module")
def processor(vl_dir):
    return load_processor(vl_dir)


class StrictVisionClient:
    """An inference client double that refuses what a server would: image placeholders without
    images, images without placeholders, or a placeholder count that differs from what the
    images expand into. It records every request and answers ``answer`` + ``<|im_end|>``."""

    def __init__(self, processor, answer: str = "3"):
        self.tok = processor.tokenizer
        self.count = image_token_counter(processor.image_processor)
        self.pad = self.tok.convert_tokens_to_ids(IMAGE_PAD)
        self.out = self.tok.encode(answer, add_special_tokens=False) + [self.tok.convert_tokens_to_ids("<|im_end|>")]
        self.requests = []

    async def agenerate(self, req):
        from PIL import Image

        images = [Image.open(io.BytesIO(base64.b64decode(b))) for b in req.image_data or []]
        expected = sum(self.count(*im.size) for im in images)
        got = req.input_ids.count(self.pad)
        assert got == expected, f"{got} <|image_pad|> tokens for images expanding to {expected}"
        assert req.input_ids.count(self.tok.convert_tokens_to_ids(VISION_START)) == len(images)
        self.requests.append(req)
        n = len(self.out)
        return Completion(req.rid, list(req.input_ids), list(self.out), [-0.5] * n, [0] * n, "stop")


def reward(prompt, completion, prompt_ids, completion_ids, answer, **_):
    return float(completion.strip() == str(answer))


async def test_rlvr_sends_images_and_stores_their_tensors(processor):
    wf = RLVRWorkflow(reward, GenerationConfig(n_samples=3, max_new_tokens=4), processor.tokenizer,
                      apply_chat_template=True, processor=processor)
    client = StrictVisionClient(processor)
    two = {"prompt": "<image> and <image>: how many?", "answer": "3", "prompt_id": 7,
           "images": [png(56, 56), base64.b64encode(png(112, 56)).decode()]}
    td = await wf.arun_episode(client, two)
    assert [base64.b64decode(b) for b in client.requests[0].image_data] == [png(56, 56), png(112, 56)]
    assert all(r.image_data == client.requests[0].image_data for r in client.requests)
    assert td["image_grid_thw"].tolist() == [[[1, 4, 4], [1, 4, 8]]] * 3
    assert td["pixel_values"].shape == (3, 16 + 32, 1176) and td["pixel_values"].dtype == torch.float32
    assert td["input_ids"][0].tolist().count(client.pad) == 4 + 8  # the expanded prompt is trained on
    assert td["rewards"].tolist() == [1.0] * 3

    one = await wf.arun_episode(client, {"prompt": "<image>", "answer": "2", "images": [png(56, 56)]})
    text = await wf.arun_episode(client, {"prompt": "no image here", "answer": "3"})
    assert client.requests[-1].image_data is None and text["pixel_values"].shape == (3, 0, 1176)
    batch = concat_trajectories([td, one, text])
    assert batch["pixel_values"].shape == (9, 48, 1176) and batch["image_grid_thw"].shape == (9, 2, 3)
    assert torch.equal(batch["pixel_values"][3, :16], one["pixel_values"][0]) and not batch["pixel_values"][3, 16:].any()
    assert batch["image_grid_thw"][3].tolist() == [[1, 4, 4], [0, 0, 0]]  # an all-zero row pads
    assert not batch["image_grid_thw"][6:].any()
    real = batch["image_grid_thw"].prod(-1).sum(-1)  # each row's real patches
    assert real.tolist() == [48] * 3 + [16] * 3 + [0] * 3


async def test_text_run_is_unchanged(processor):
    wf = RLVRWorkflow(reward, GenerationConfig(n_samples=2, max_new_tokens=4), processor.tokenizer)
    client = StrictVisionClient(processor)
    td = await wf.arun_episode(client, {"prompt": "What is 1 + 2?", "answer": "3"})
    assert client.requests[0].image_data is None
    assert "pixel_values" not in td and "image_grid_thw" not in td


async def test_multi_turn_carries_images_on_every_turn(processor):
    wf = MultiTurnWorkflow(reward, GenerationConfig(n_samples=2, max_new_tokens=4), processor.tokenizer,
                           max_turns=2, processor=processor)
    client = StrictVisionClient(processor, answer="wrong")
    td = await wf.arun_episode(client, {"prompt": [{"role": "user", "content": "<image> count"}], "answer": "3",
                                        "images": [png(56, 112)]})
    assert len(client.requests) == 4  # 2 conversations x 2 turns
    assert all([base64.b64decode(b) for b in r.image_data] == [png(56, 112)] for r in client.requests)
    second = client.requests[-1].input_ids
    assert second[: len(client.requests[0].input_ids)] == client.requests[0].input_ids  # token-in, images kept
    assert td["image_grid_thw"].tolist() == [[[1, 8, 4]]] * 2 and td["pixel_values"].shape == (2, 32, 1176)


def test_pad_and_stack_pads_every_key_along_its_rows():
    rows = [{"input_ids": torch.tensor([1, 2, 3]), "pixel_values": torch.ones(2, 4)},
            {"input_ids": torch.tensor([5]), "pixel_values": torch.ones(5, 4)}]
    td = pad_and_stack(rows)
    assert td["input_ids"].tolist() == [[1, 2, 3], [5, 0, 0]]
    assert td["pixel_values"].shape == (2, 5, 4) and td["pixel_values"][0].sum() == 8


def test_from_config_loads_the_processor_of_a_vision_model(vl_dir, micro_model_dir, processor):
    from arealite.config.schema import ArealiteConfig

    def cfg(model):
        return ArealiteConfig.model_validate({"actor": {"model_path": str(model)},
                                              "data": {"image_key": "pics", "max_image_pixels": 5000}})

    wf = RLVRWorkflow.from_config(cfg(vl_dir), processor.tokenizer)
    assert wf.processor is not None and (wf.image_key, wf.max_image_pixels) == ("pics", 5000)
    assert MultiTurnWorkflow.from_config(cfg(vl_dir), processor.tokenizer).processor is not None
    assert RLVRWorkflow.from_config(cfg(micro_model_dir), processor.tokenizer).processor is None


async def test_rlvr_images_reach_sglangs_wire_form(processor, fakes):  # noqa: F811
    """Workflow -> the real SGLang client -> a fake SGLang server: every request of the group
    carries the expanded prompt and the item's images as ``image_data`` (base64, in order)."""
    from arealite.inference_client.sglang_client import SGLangClient
    from tests.test_client import cfg

    (f,) = await fakes(1)
    wf = RLVRWorkflow(reward, GenerationConfig(n_samples=2, max_new_tokens=3), processor.tokenizer,
                      apply_chat_template=True, processor=processor)
    images = [png(56, 56), png(56, 112, (0, 0, 255))]
    async with SGLangClient([f.addr], cfg()) as client:
        td = await wf.arun_episode(client, {"prompt": "<image> <image> where?", "answer": "1", "images": images})
    assert len(f.generate_payloads) == 2
    pad = processor.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    for sent in f.generate_payloads:
        assert [base64.b64decode(b) for b in sent["image_data"]] == images
        assert sent["input_ids"].count(pad) == 4 + 8
        assert sent["input_ids"] == td["input_ids"][0, : len(sent["input_ids"])].tolist()
    assert td["image_grid_thw"].tolist() == [[[1, 4, 4], [1, 8, 4]]] * 2


@pytest.mark.slow
async def test_rlvr_against_the_embedded_server_running_the_vlm(vl_dir, processor):
    """The real path: workflow -> SGLang client -> the embedded server running vl-micro with the
    images. Every sample comes back on the expanded prompt and the rows carry the image keys."""
    from arealite.inference_client.sglang_client import SGLangClient
    from arealite.server.process import ServerProcess
    from tests.conftest import free_port
    from tests.test_client import cfg

    proc = ServerProcess(vl_dir, free_port(), threads=1, extra_args=["--random-seed", "0"])
    try:
        addr = proc.wait_healthy(120).url.removeprefix("http://")
        wf = RLVRWorkflow(reward, GenerationConfig(n_samples=3, max_new_tokens=3), processor.tokenizer,
                          apply_chat_template=True, processor=processor)
        items = [{"prompt": "<image> and <image>?", "answer": "1", "images": [png(56, 56), png(112, 56, (0, 0, 255))]},
                 {"prompt": "no image", "answer": "1"}]
        async with SGLangClient([addr], cfg()) as client:
            two, text = [await wf.arun_episode(client, it) for it in items]
    finally:
        proc.stop()
    batch = concat_trajectories([two, text])
    assert batch["image_grid_thw"].tolist()[:3] == [[[1, 4, 4], [1, 4, 8]]] * 3 and not batch["image_grid_thw"][3:].any()
    pad = processor.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    assert two["input_ids"][0].tolist().count(pad) == 12
    assert (two["loss_mask"].sum(1) >= 1).all() and (two["logprobs"][two["loss_mask"]] < 0).all()
