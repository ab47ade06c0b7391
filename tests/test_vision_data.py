"""Vision-language data: the tiny VLM, images from every source, prompts through the processor,
datasets with images checked before a run starts (docs/vision.md)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch

from arealite.models.tiny import IMAGE_PAD, VISION_END, VISION_START, build_tiny_model
from arealite.vision.image_io import ImageError, image_bytes, open_image, to_png_bytes
from arealite.vision.processor import load_processor
from arealite.vision.prompt import VISION_BLOCK, render_vision_prompt


def png(w: int, h: int, color=(255, 0, 0)) -> bytes:
    from PIL import Image

    return to_png_bytes(Image.new("RGB", (w, h), color))


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("vl") / "vl-micro", size="vl-micro", seed=0)


@pytest.fixture(scope="module")
def processor(vl_dir):
    return load_processor(vl_dir)


# --- the tiny VLM ---------------------------------------------------------------------------

def test_vl_micro_loads_like_a_hub_model(vl_dir, processor):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    cfg = json.loads((vl_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen2_5_vl" and cfg["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert json.loads((vl_dir / "processor_config.json").read_text())["processor_class"] == "Qwen2_5_VLProcessor"
    tok = AutoTokenizer.from_pretrained(vl_dir)
    for t in (VISION_START, VISION_END, IMAGE_PAD):  # single special tokens, never split
        assert len(tok(t, add_special_tokens=False)["input_ids"]) == 1
    assert tok.convert_tokens_to_ids(IMAGE_PAD) == cfg["image_token_id"]
    model = AutoModelForImageTextToText.from_pretrained(vl_dir)
    vp = render_vision_prompt(processor, "How many shapes? <image>", [png(56, 56)], apply_chat_template=True)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([vp.input_ids]), pixel_values=vp.pixel_values,
                       image_grid_thw=vp.image_grid_thw).logits
    assert logits.shape == (1, len(vp.input_ids), model.config.text_config.vocab_size)
    assert torch.isfinite(logits).all()


def test_processor_expands_each_image_into_its_merged_patches(processor):
    # 56x56 -> 4x4 patches of 14 -> 2x2 merged = 4 pads; 112x56 -> 8x4 -> 8 pads.
    vp = render_vision_prompt(processor, [{"role": "user", "content": "<image> then <image>: which?"}],
                              [png(56, 56), png(56, 112)])
    pad = processor.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    assert vp.image_grid_thw.tolist() == [[1, 4, 4], [1, 8, 4]]
    assert vp.input_ids.count(pad) == 4 + 8
    assert vp.pixel_values.shape == (16 + 32, 3 * 2 * 14 * 14) and vp.pixel_values.dtype == torch.float32
    text = processor.tokenizer.decode(vp.input_ids)
    assert text.startswith("<|im_start|>user\n" + VISION_START) and text.endswith("<|im_start|>assistant\n")
    assert text.count(VISION_START) == 2 and text.count(VISION_END) == 2
    # base64 of the file bytes, in placeholder order
    assert base64.b64decode(vp.image_data[1]) == png(56, 112)


def test_chat_template_renders_image_content_parts(processor):
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "where?"}]}]
    text = processor.apply_chat_template(parts, add_generation_prompt=True, tokenize=False)
    assert text == f"<|im_start|>user\n{VISION_BLOCK}where?<|im_end|>\n<|im_start|>assistant\n"
    plain = render_vision_prompt(processor, "Q: <image>", [png(56, 56)], apply_chat_template=False)
    assert processor.tokenizer.decode(plain.input_ids).startswith("Q: " + VISION_START)


def test_image_count_must_match_placeholders(processor):
    with pytest.raises(ImageError, match=r"row 3: the prompt places 1 image\(s\).*has 2"):
        render_vision_prompt(processor, "<image>", [png(56, 56)] * 2, where="row 3")


# --- images from every source ---------------------------------------------------------------

def test_image_sources_give_the_same_bytes(tmp_path):
    data = png(20, 10)
    (tmp_path / "a.png").write_bytes(data)
    b64 = base64.b64encode(data).decode()
    for source in (str(tmp_path / "a.png"), b64, f"data:image/png;base64,{b64}", data,
                   {"bytes": data, "path": None}, {"path": str(tmp_path / "a.png")}):
        assert image_bytes(source) == data
    assert open_image(data).size == (20, 10)


@pytest.mark.parametrize("source, match", [
    ("missing.png", r"f:1 field 'images'\[0\]: image file not found: missing.png"),
    ("not base64!", "neither an image file path .* nor valid base64"),
    ("data:image/png,xyz", "data URL must be"),
    (12, "got int"),
])
def test_bad_image_sources_are_named(source, match):
    with pytest.raises(ImageError, match=match):
        image_bytes(source, "f:1 field 'images'[0]")


def test_undecodable_and_oversized_images_are_refused():
    with pytest.raises(ImageError, match="r 2: not a decodable image"):
        open_image(b"\x89PNG not really", "r 2")
    with pytest.raises(ImageError, match=r"100x50 = 5000 pixels > data.max_image_pixels = 4999"):
        open_image(png(100, 50), "r", max_pixels=4999)
    assert open_image(png(100, 50), "r", max_pixels=5000).size == (100, 50)


# --- datasets with images, checked before a run -----------------------------------------------

from arealite.config.schema import ArealiteConfig
from arealite.data.dataset import DatasetError, load_items
from arealite.data.validate import validate_datasets
from arealite.vision.dataset_checks import dataset_image_tokens, validate_images


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_rows_take_paths_base64_and_data_urls(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(png(30, 20))
    b64 = base64.b64encode(png(10, 10)).decode()
    path = write_jsonl(tmp_path / "train.jsonl", [
        {"prompt": "<image>", "answer": 1, "images": "img/a.png"},  # one image, bare
        {"prompt": [{"role": "user", "content": "<image> vs <image>"}], "answer": 2,
         "images": [b64, f"data:image/png;base64,{b64}"]},
        {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "n?"}]}],
         "answer": 3, "images": ["img/a.png"]},
        {"prompt": "text only", "answer": 4},
    ])
    rows = load_items(path, image_key="images")
    assert rows[0]["images"] == [str(tmp_path / "img" / "a.png")]  # relative to the data file
    assert image_bytes(rows[1]["images"][1]) == png(10, 10)
    assert validate_images(rows, image_tokens=lambda w, h: w * h) == [600, 200, 600, 0]


def test_parquet_and_saved_dataset_image_columns(tmp_path):
    datasets = pytest.importorskip("datasets")
    a, b = png(8, 8), png(16, 8, (0, 0, 255))
    feats = datasets.Features({"prompt": datasets.Value("string"), "answer": datasets.Value("int64"),
                               "images": datasets.List(datasets.Image())})
    ds = datasets.Dataset.from_dict({"prompt": ["<image>", "<image><image>"], "answer": [1, 2],
                                     "images": [[{"bytes": a, "path": None}], [{"bytes": a, "path": None},
                                                                               {"bytes": b, "path": None}]]},
                                    features=feats)
    ds.save_to_disk(str(tmp_path / "saved"))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["<image>"], "answer": [1], "images": [[b]]}), tmp_path / "t.parquet")
    for path in (tmp_path / "saved", tmp_path / "t.parquet"):
        rows = load_items(path, image_key="images")
        assert validate_images(rows, image_tokens=lambda w, h: 1) == [len(r["images"]) for r in rows]
    assert image_bytes(load_items(tmp_path / "saved", image_key="images")[1]["images"][1]) == b


def test_bad_images_are_named_by_file_row_and_field(tmp_path):
    (tmp_path / "big.png").write_bytes(png(200, 100))
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    path = write_jsonl(tmp_path / "train.jsonl", [
        {"prompt": "<image>", "answer": 1, "images": ["missing.png"]},
        {"prompt": "<image>", "answer": 1, "images": ["broken.png"]},
        {"prompt": "<image>", "answer": 1, "images": ["big.png"]},
        {"prompt": "<image> <image>", "answer": 1, "images": ["big.png"]},
        {"prompt": "fine", "answer": 1},
    ])
    with pytest.raises(DatasetError) as info:
        validate_images(load_items(path, image_key="images"), max_pixels=10_000, dataset="data.train_path")
    msg = str(info.value)
    assert msg.startswith("data.train_path: 4 of 5 rows have unusable images:")
    assert f"train.jsonl:1 field 'images'[0]: image file not found: {tmp_path / 'missing.png'}" in msg
    assert "train.jsonl:2 field 'images'[0]: " in msg and "decod" in msg
    assert "train.jsonl:3 field 'images'[0]: 200x100 = 20000 pixels > data.max_image_pixels = 10000" in msg
    assert "train.jsonl:4: field 'prompt' places 2 image(s)" in msg and "field 'images' holds 1" in msg


def test_validate_datasets_counts_image_tokens_for_a_vision_model(tmp_path, vl_dir):
    from arealite.trainer.build import load_data

    (tmp_path / "a.png").write_bytes(png(112, 112))  # 16 image tokens
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "<image> how many?", "answer": 1, "images": ["a.png"]}])
    items = load_items(path, image_key="images")
    tok = load_processor(vl_dir).tokenizer
    cfg = ArealiteConfig.model_validate({"actor": {"model_path": str(vl_dir)}, "rollout": {"consumer_batch_size": 1},
                                         "data": {"train_path": str(path), "max_prompt_len": 64}})
    n_text = len(tok("<image> how many?", add_special_tokens=False)["input_ids"])
    image_tokens = dataset_image_tokens(cfg, items)
    assert image_tokens == {"train": [16]}
    assert validate_datasets(cfg, tok, items, extra_tokens=image_tokens)["train"] == [n_text + 16]
    assert len(load_data(cfg, tok)[0]) == 1  # the trainer's loading runs both checks
    cfg.data.max_prompt_len = n_text + 15
    with pytest.raises(DatasetError, match=r"train.jsonl:1 \(prompt_id 0\): \d+ tokens > data.max_prompt_len"):
        load_data(cfg, tok)
    cfg.data.max_prompt_len, cfg.data.max_image_pixels = None, 100
    with pytest.raises(DatasetError, match=r"train.jsonl:1 field 'images'\[0\]: 112x112 = 12544 pixels"):
        load_data(cfg, tok)


def test_vision_demo_prepare_writes_data_the_run_accepts(tmp_path):
    """examples/vision/prepare.py: images beside the JSONL, rows the loader and the image checks
    accept, and a warmed-up policy that loads with its processor (a few steps only here)."""
    import subprocess
    import sys

    from conftest import REPO, run_env

    out = tmp_path / "demo"
    res = subprocess.run([sys.executable, "examples/vision/prepare.py", "--out", str(out), "--n-train", "40",
                          "--n-eval", "20", "--warmup-steps", "4", "--batch-size", "8"],
                         cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "[warm-up] step 4/4" in res.stdout and "held-out greedy accuracy" in res.stdout
    rows = load_items(out / "train.jsonl", image_key="images")
    assert len(rows) == 40 and rows[0]["images"][0].startswith(str(out / "images"))
    assert {r["answer"] for r in rows} <= {"1", "2", "3", "4"}
    assert validate_images(rows, max_pixels=56 * 56) == [0] * 40
    from PIL import Image

    for r in rows:  # the answer is the number of quadrants (merged image tokens) holding a shape
        img = Image.open(r["images"][0]).convert("RGB")
        inked = [img.crop((x, y, x + 28, y + 28)).getextrema() != ((255, 255),) * 3
                 for x in (0, 28) for y in (0, 28)]
        assert sum(inked) == int(r["answer"]), r
    proc = load_processor(out / "model")
    vp = render_vision_prompt(proc, rows[0]["prompt"], [image_bytes(rows[0]["images"][0])])
    assert vp.image_grid_thw.tolist() == [[1, 4, 4]]  # one merged token per quadrant


def test_vision_demo_warm_up_uses_the_servers_3d_positions(tmp_path):
    """The warm-up must train under the 3-D rope positions that the server and the trainer use
    (`arealite.vision.rope`): transformers' forward falls back to 1-D positions when it is given
    neither ``position_ids`` nor ``mm_token_type_ids``, which made a different policy."""
    import sys

    import torch
    from conftest import REPO
    from transformers import AutoConfig

    from arealite.models.tiny import build_tiny_model
    from arealite.vision.rope import mrope_positions

    sys.path.insert(0, str(REPO / "examples" / "vision"))
    try:
        import prepare
    finally:
        sys.path.pop(0)
    base = build_tiny_model(tmp_path / "m", size="vl-micro", seed=0)
    rows = prepare.write_split(tmp_path, "train", 3, seed=0)
    proc, cfg = load_processor(base), AutoConfig.from_pretrained(base)
    enc = prepare.Encoded(proc, cfg, rows, tmp_path)
    b = enc.batch([0, 2], [1, 3])
    assert b["position_ids"].shape == (3, 2, b["input_ids"].shape[1])
    for i in range(2):
        want = mrope_positions(cfg, b["input_ids"][i], enc.grid)
        assert torch.equal(b["position_ids"][:, i], want)
    assert not torch.equal(want[1], want[2])  # height and width differ on the image tokens
