"""Images on the inference path: the client's SGLang wire form for ``image_data`` (every
segment of an interrupted request carries its images; the batch form carries one list per
request), the text-only embedded server's refusal of images (docs/sglang.md, Images), and the
embedded server running the tiny Qwen2.5-VL (`arealite.server.vision`) against an HF forward."""

from __future__ import annotations

import asyncio
import io
import json

import aiohttp
import pytest
import torch

from arealite.inference_client.sglang_client import SGLangClient
from arealite.server.process import ServerProcess
from arealite.server.generate_request import RequestError, parse_generate
from arealite.vision.image_io import encode_base64
from tests.test_client import cfg, fakes, req, tok  # noqa: F401  (fakes: the fixture)
from tests.test_server_generate import free_port, post

IMAGES = ["iVBORw0KGgoAAAANSUhEUgAAAAE=", "R0lGODlhAQABAAAAACw="]


async def test_an_interrupted_request_resumes_with_its_images(fakes):  # noqa: F811
    (f,) = await fakes(1, token_delay=0.005)
    async with SGLangClient([f.addr], cfg()) as eng:
        task = asyncio.create_task(eng.agenerate(req(n_prompt=4, max_new=30, image_data=list(IMAGES))))
        await asyncio.sleep(0.05)
        await eng.pause_generation()
        while not eng.stats()["aborts"]:
            await asyncio.sleep(0.01)
        await eng.continue_generation()
        c = await asyncio.wait_for(task, 5)
    assert c.n_interruptions == 1 and c.output_ids == [tok(4 + i) for i in range(30)]
    first, second = f.generate_payloads
    assert first["image_data"] == IMAGES and second["image_data"] == IMAGES
    assert second["input_ids"] == list(range(10, 14)) + c.output_ids[: len(second["input_ids"]) - 4]


async def test_text_only_requests_send_no_image_field(fakes):  # noqa: F811
    (f,) = await fakes(1)
    async with SGLangClient([f.addr], cfg()) as eng:
        await eng.agenerate(req(n_prompt=3, max_new=2))
    assert "image_data" not in f.generate_bodies[0]


async def test_a_batch_carries_one_image_list_per_request(fakes):  # noqa: F811
    (f,) = await fakes(1)
    async with SGLangClient([f.addr], cfg()) as eng:
        reqs = [req(n_prompt=3, max_new=2, image_data=IMAGES[:1], affinity_key="g"),
                req(n_prompt=4, max_new=2, affinity_key="g"),
                req(n_prompt=5, max_new=2, image_data=list(IMAGES), affinity_key="g")]
        await asyncio.gather(*(eng.agenerate(r) for r in reqs))
    (batch,) = f.generate_bodies  # one group, one batched /generate
    assert {len(ids): images for ids, images in zip(batch["input_ids"], batch["image_data"])} == {
        3: IMAGES[:1], 4: [], 5: IMAGES}


def test_the_text_only_embedded_server_refuses_image_data_naming_the_field():
    body = {"input_ids": [1, 2, 3], "image_data": IMAGES[:1], "sampling_params": {"max_new_tokens": 2}}
    with pytest.raises(RequestError, match="image_data"):
        parse_generate(body, vocab_size=100, context_length=64, encode=None)
    body.pop("image_data")
    seqs, batch = parse_generate(body, vocab_size=100, context_length=64, encode=None)
    assert not batch and len(seqs) == 1


# --------------------------------------------------------------------------
# The embedded server running the tiny Qwen2.5-VL (a real child on 127.0.0.1, fp32)
# --------------------------------------------------------------------------

def _png(w: int, h: int, seed: int) -> bytes:
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    px = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    from arealite.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("vl") / "vl-micro", size="vl-micro", seed=0)


@pytest.fixture(scope="module")
def vl_server(vl_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("vl_server") / "server.log"
    proc = ServerProcess(vl_dir, free_port(), extra_args=["--random-seed", "7", "--max-batch-size", "8",
                                                          "--dtype", "float32", "--max-image-bytes", "80000",
                                                          "--max-image-pixels", "30000"], log_path=log, threads=1)
    try:
        yield proc.wait_healthy()
    finally:
        proc.stop()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        yield s


def _vl_prompts(vl_dir):
    from arealite.vision.processor import load_processor
    from arealite.vision.prompt import render_vision_prompt

    proc = load_processor(vl_dir)
    specs = [("Two <image> and <image> shapes?", [_png(56, 56, 1), _png(84, 112, 2)]),
             ("What is in <image>?", [_png(112, 84, 3)]),
             ("No image, just text.", []),
             ("Three: <image><image> then <image>.", [_png(56, 84, 4), _png(56, 56, 5), _png(70, 70, 6)])]
    return [render_vision_prompt(proc, text, images) for text, images in specs]


def _hf_greedy_logprobs(model, vp, output):
    """HF's own forward of prompt + output: with ``mm_token_type_ids`` it computes the 3-D rope
    positions itself (without them it would fall back to 1-D positions)."""
    ids = torch.tensor([vp.input_ids + output])
    kw = {"pixel_values": vp.pixel_values, "image_grid_thw": vp.image_grid_thw,
          "mm_token_type_ids": (ids == model.config.image_token_id).int()} if vp.image_data else {}
    model.model.rope_deltas = None  # HF caches a generation's delta on the model
    with torch.no_grad():
        logits = model(input_ids=ids, **kw).logits[0, len(vp.input_ids) - 1:-1].float()
    return torch.log_softmax(logits, -1)


async def test_the_vl_server_matches_an_hf_forward_on_images_batched_with_text(vl_server, vl_dir, http):
    from transformers import AutoModelForImageTextToText

    prompts = _vl_prompts(vl_dir)
    sp = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    reqs = [{"input_ids": vp.input_ids, "sampling_params": {**sp, "max_new_tokens": 6 + 3 * i},
             "return_logprob": True, **({"image_data": vp.image_data} if vp.image_data else {})}
            for i, vp in enumerate(prompts)]
    # Concurrent single requests, then the same as one batch (one image list per prompt).
    singles = await asyncio.gather(*(post(http, vl_server, "/generate", r) for r in reqs))
    batch = await post(http, vl_server, "/generate", {
        "input_ids": [vp.input_ids for vp in prompts], "image_data": [vp.image_data for vp in prompts],
        "sampling_params": sp, "return_logprob": True})
    model = AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32).eval()
    for vp, out in [*zip(prompts, singles), *zip(prompts, batch)]:
        full = _hf_greedy_logprobs(model, vp, out["output_ids"])
        got = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
        ref = full.gather(1, torch.tensor(out["output_ids"])[:, None])[:, 0]
        assert full.argmax(-1).tolist() == out["output_ids"]
        assert (got - ref).abs().max().item() <= 1e-4, (got - ref).abs().max().item()
    # An interrupted request resumes with its images: prompt + the tokens so far, same image_data.
    vp, out = prompts[0], batch[0]
    rest = await post(http, vl_server, "/generate", {
        "input_ids": vp.input_ids + out["output_ids"][:3], "image_data": vp.image_data,
        "sampling_params": {**sp, "max_new_tokens": 5}, "return_logprob": True})
    assert rest["output_ids"] == out["output_ids"][3:]
    resumed = torch.tensor([x[0] for x in rest["meta_info"]["output_token_logprobs"]])
    whole = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]][3:])
    assert (resumed - whole).abs().max().item() <= 1e-4
    info = await (await http.get(vl_server.url + "/get_model_info")).json()
    assert info["has_image_understanding"] is True
    state = (await (await http.get(vl_server.url + "/get_server_info")).json())["internal_states"][0]
    assert state["max_running"] >= 4, "the image and text requests were not batched together"


async def test_the_prompt_cache_never_shares_kv_between_different_images(vl_server, vl_dir, http):
    vp, other = _vl_prompts(vl_dir)[0], encode_base64(_png(56, 56, 99))
    body = {"input_ids": vp.input_ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
            "return_logprob": True}
    mine, theirs = {**body, "image_data": vp.image_data}, {**body, "image_data": [other, vp.image_data[1]]}
    # Sequential (the prompt cache between admissions) and concurrent (one prefill shared by equal prompts).
    a = await post(http, vl_server, "/generate", mine)
    b = await post(http, vl_server, "/generate", theirs)
    a2 = await post(http, vl_server, "/generate", mine)
    c, d = await asyncio.gather(post(http, vl_server, "/generate", {**mine, "sampling_params": {
        "max_new_tokens": 3, "temperature": 0.0}}), post(http, vl_server, "/generate", theirs))
    lps = [x["meta_info"]["output_token_logprobs"] for x in (a, b, a2, c, d)]
    assert b["meta_info"]["cached_tokens"] == 0 and a2["meta_info"]["cached_tokens"] > 0  # same images: a hit
    assert lps[0] != lps[1] and lps[0] == lps[2] and lps[3] == lps[0][:3] and lps[4] == lps[1]


async def test_the_vl_server_answers_400_naming_image_data(vl_server, vl_dir, http):
    vp = _vl_prompts(vl_dir)[0]
    sp = {"max_new_tokens": 2}
    for images in (vp.image_data[:1], vp.image_data + vp.image_data[:1]):  # 2 blocks, 1 or 3 images
        err = await post(http, vl_server, "/generate", {"input_ids": vp.input_ids, "image_data": images,
                                                        "sampling_params": sp}, status=400)
        assert "image_data" in json.dumps(err) and "image block" in json.dumps(err)
    big = encode_base64(_solid_png(5000, 4000))  # 20M pixels > the fixture's 30000 cap; a small file
    err = await post(http, vl_server, "/generate", {"input_ids": vp.input_ids, "image_data": [big, big],
                                                    "sampling_params": sp}, status=400)
    assert "image_data[0]" in json.dumps(err) and "pixels" in json.dumps(err)
    err = await post(http, vl_server, "/generate", {"input_ids": vp.input_ids, "image_data": ["not base64!", big],
                                                    "sampling_params": sp}, status=400)
    assert "image_data[0]" in json.dumps(err)


async def test_one_pad_per_image_is_expanded_as_sglang_does(vl_server, vl_dir, http):
    """Ids with one <|image_pad|> per image (as a chat template renders them, unexpanded) answer
    exactly as the expanded ids; a run of any other length is a 400 naming the image."""
    from transformers import AutoConfig

    pad = AutoConfig.from_pretrained(vl_dir).image_token_id
    vp = _vl_prompts(vl_dir)[0]  # two images
    short = [t for i, t in enumerate(vp.input_ids) if t != pad or vp.input_ids[i - 1] != pad]
    assert short.count(pad) == 2 and len(short) < len(vp.input_ids)
    body = {"image_data": vp.image_data, "sampling_params": {"max_new_tokens": 5, "temperature": 0.0},
            "return_logprob": True}
    whole = await post(http, vl_server, "/generate", {**body, "input_ids": vp.input_ids})
    one = await post(http, vl_server, "/generate", {**body, "input_ids": short})
    assert one["output_ids"] == whole["output_ids"]
    assert one["meta_info"]["prompt_tokens"] == whole["meta_info"]["prompt_tokens"] == len(vp.input_ids)
    lp = [[x[0] for x in r["meta_info"]["output_token_logprobs"]] for r in (one, whole)]
    assert torch.allclose(torch.tensor(lp[0]), torch.tensor(lp[1]), atol=1e-5)
    first = short.index(pad)
    odd = short[:first] + [pad, pad] + short[first + 1:]  # two pads: neither one nor the grid's count
    err = await post(http, vl_server, "/generate", {**body, "input_ids": odd}, status=400)
    assert "image_data[0]" in json.dumps(err) and "holds 2 <|image_pad|>" in json.dumps(err)


async def test_a_generated_image_pad_resumes_as_text(vl_server, vl_dir, http):
    """A continuation whose answer so far holds <|image_pad|> (the policy sampled it) is not a new
    image: the server answers as for any other token, greedy tokens and log-probs those of an HF
    forward from embeddings with the image features at the prompt's pads only."""
    from transformers import AutoModelForImageTextToText

    vp = _vl_prompts(vl_dir)[1]  # one image
    model = AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32).eval()
    pad = model.config.image_token_id
    prompt = vp.input_ids + [pad, 9]  # the answer so far: a pad, then a word
    out = await post(http, vl_server, "/generate", {
        "input_ids": prompt, "image_data": vp.image_data, "return_logprob": True,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}})
    ids = torch.tensor([prompt + out["output_ids"]])
    slots = (ids == pad) & (torch.arange(ids.shape[1]) < len(vp.input_ids))
    with torch.no_grad():
        emb = model.get_input_embeddings()(ids).clone()
        emb[slots] = torch.cat(list(model.model.get_image_features(
            vp.pixel_values, vp.image_grid_thw, return_dict=True).pooler_output))
        pos, _ = model.model.get_rope_index(ids, mm_token_type_ids=slots.int(), image_grid_thw=vp.image_grid_thw)
        logits = model(inputs_embeds=emb, position_ids=pos).logits[0, len(prompt) - 1:-1].float()
    full = torch.log_softmax(logits, -1)
    assert full.argmax(-1).tolist() == out["output_ids"]
    got = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
    assert (got - full.gather(1, torch.tensor(out["output_ids"])[:, None])[:, 0]).abs().max().item() <= 1e-4


def _solid_png(w: int, h: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()



def test_image_cap_flags_parse():
    from arealite.server.args import parse_args

    args = parse_args(["--model-path", "m", "--max-image-bytes", "2000", "--max-image-pixels", "3000"])
    assert (args.max_image_bytes, args.max_image_pixels) == (2000, 3000)
    assert (parse_args(["--model-path", "m"]).max_image_pixels, args.__class__.max_image_bytes) == (4096 * 4096, 32 << 20)
    for flag in ("--max-image-bytes", "--max-image-pixels"):
        with pytest.raises(SystemExit):
            parse_args(["--model-path", "m", flag, "0"])


async def test_the_caps_set_on_the_command_line_give_a_400(vl_server, vl_dir, http):
    """The fixture's server runs with ``--max-image-bytes 80000 --max-image-pixels 30000``: the
    test images pass, a larger one is a 400 naming the image and the cap."""
    from arealite.vision.processor import load_processor
    from arealite.vision.prompt import render_vision_prompt

    proc = load_processor(vl_dir)
    wide, noisy = _solid_png(200, 160), _png(170, 170, 9)  # 32000 px in a small file; 28900 px of noise
    assert len(wide) < 80_000 < len(noisy)
    for image, cap in ((wide, "30000 pixels"), (noisy, "cap of 80000")):
        vp = render_vision_prompt(proc, "What is in <image>?", [image])
        err = json.dumps(await post(http, vl_server, "/generate", {
            "input_ids": vp.input_ids, "image_data": vp.image_data, "sampling_params": {"max_new_tokens": 2}}, status=400))
        assert "image_data[0]" in err and cap in err, err
