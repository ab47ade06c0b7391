"""Training a vision-language model (issue 33): packed micro-batches with 0, 1 and 2 images per
row score as a plain per-row HF forward; 2 gloo ranks match one process on the same batch;
``actor.freeze_vision`` leaves the vision tower untouched; 2 ranks splitting each micro-batch by
sequence parallelism match one process; tp with a VLM is refused."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vision_batches import hf_row_logprobs, vision_batch  # noqa: E402

from arealite.train_engine.parallel.layout import ParallelLayout  # noqa: E402
from arealite.train_engine.parallel.sequence_images import local_images  # noqa: E402
from arealite.train_engine.packing import PackedIndex  # noqa: E402
from arealite.train_engine.vision_inputs import pack_images, split_vision_keys  # noqa: E402


def two_ranks(model_dir: Path, out: Path, *extra: str, results: bool = True) -> list[dict]:
    """tests/_vision_worker.py under ``torchrun --nproc_per_node 2`` (gloo); each rank's result."""
    import os
    import subprocess

    from arealite.utils.dist import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(Path(__file__).parent / "_vision_worker.py"), str(model_dir),
           str(out), *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return [torch.load(out / f"result_rank{r}.pt", weights_only=False) for r in range(2)] if results else []


@pytest.fixture(scope="module")
def vl_model_dir(tmp_path_factory) -> Path:
    from arealite.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("vl") / "model", size="vl-micro")


@pytest.fixture(scope="module")
def vl_batch(vl_model_dir) -> dict[str, torch.Tensor]:
    return vision_batch(vl_model_dir)


@pytest.fixture(scope="module")
def worker():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_vision_worker", Path(__file__).parent / "_vision_worker.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def one_process(vl_model_dir, worker) -> dict:
    return worker.run(str(vl_model_dir), "")


@pytest.fixture(scope="module")
def hf_model(vl_model_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(vl_model_dir, dtype=torch.float32, attn_implementation="eager")


def test_batch_has_rows_with_0_1_2_images(vl_batch):
    n_images = (vl_batch["image_grid_thw"] != 0).any(-1).sum(-1).tolist()
    assert n_images == [0, 1, 2, 1]


@pytest.mark.parametrize("mb_max_tokens", [1000, 60])  # all rows packed in one micro-batch; several
def test_packed_logprobs_equal_per_row_hf_forward(vl_model_dir, vl_batch, hf_model, worker, mb_max_tokens):
    engine = worker.engine_for(str(vl_model_dir), mb_max_tokens=mb_max_tokens)
    try:
        plan = engine.planner.plan(dict(vl_batch))
        assert len(plan) == (1 if mb_max_tokens == 1000 else len(plan)) and len(plan) >= 1
        if mb_max_tokens == 1000:
            assert plan[0].tensors["image_grid_thw"].shape[0] == 4 and len(plan[0].index.rows) == 4
        out = engine.forward(vl_batch, worker.label_logprobs)
    finally:
        engine.destroy()
    for b in range(vl_batch["input_ids"].shape[0]):
        n = int(vl_batch["attention_mask"][b].sum())
        torch.testing.assert_close(out[b, :n], hf_row_logprobs(hf_model, vl_batch, b), atol=1e-5, rtol=0)
        assert (out[b, n:] == 0).all()


def test_pack_images_concatenates_real_patches_and_positions(vl_model_dir, vl_batch):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(vl_model_dir)
    text, images = split_vision_keys(dict(vl_batch))
    assert set(images) == {"pixel_values", "image_grid_thw"} and "pixel_values" not in text
    lengths = vl_batch["attention_mask"].sum(-1).tolist()
    index = PackedIndex(rows=[2, 0], lengths=[lengths[2], lengths[0]])
    out = pack_images(images, vl_batch["input_ids"], index, cfg)
    grids = vl_batch["image_grid_thw"][2]
    n = int(grids.prod(-1).sum())
    assert torch.equal(out["pixel_values"], vl_batch["pixel_values"][2, :n])
    assert torch.equal(out["image_grid_thw"], grids)
    assert out["mrope_position_ids"].shape == (3, sum(index.lengths))
    # The text-only row's positions restart at 0 and run in all three dimensions alike.
    tail = out["mrope_position_ids"][:, lengths[2]:]
    assert torch.equal(tail, torch.arange(lengths[0]).expand(3, -1))
    # An image makes the three dimensions differ, and the position after it jumps less than its tokens.
    head = out["mrope_position_ids"][:, :lengths[2]]
    assert not torch.equal(head[0], head[1]) and int(head[0].max()) < lengths[2] - 1
    text_only = pack_images(images, vl_batch["input_ids"], PackedIndex(rows=[0], lengths=[lengths[0]]), cfg)
    assert "pixel_values" not in text_only


def test_bad_image_keys_are_refused(vl_model_dir, vl_batch):
    from transformers import AutoConfig

    with pytest.raises(KeyError, match="image_grid_thw"):
        split_vision_keys({k: v for k, v in vl_batch.items() if k != "image_grid_thw"})
    _, images = split_vision_keys(dict(vl_batch))
    short = {**images, "image_grid_thw": images["image_grid_thw"].clone()}
    short["image_grid_thw"][1, 0, 1] += 2  # the grid no longer matches the row's image tokens
    lengths = vl_batch["attention_mask"].sum(-1).tolist()
    with pytest.raises(ValueError, match="batch row 1"):
        pack_images(short, vl_batch["input_ids"], PackedIndex(rows=[1], lengths=[lengths[1]]),
                    AutoConfig.from_pretrained(vl_model_dir))


def test_layout_splits_a_vlm_by_sequence_but_not_by_tensor(vl_model_dir):
    import json

    hf = json.loads((vl_model_dir / "config.json").read_text())
    assert ParallelLayout(world=2, sp=2).problems("actor", hf_config=hf) == []
    problems = ParallelLayout(world=2, tp=2).problems("actor", hf_config=hf)
    assert [p.path for p in problems if "vision-language" in p.message] == ["actor.tp_size"]


def test_local_images_keep_the_features_of_the_share():
    # Two images of 2 and 3 merged tokens (grids of 8 and 12 patches, merge 2); slots 2-3 and 5-7.
    slots = torch.tensor([0, 0, 1, 1, 0, 1, 1, 1, 0, 0], dtype=torch.bool)
    grid = torch.tensor([[1, 2, 4], [1, 2, 6]])
    patches = torch.arange(20.0)[:, None]
    left = local_images(slots, patches, grid, 2, slice(0, 6))  # image 0 whole, image 1's first slot
    assert torch.equal(left.image_grid_thw, grid) and left.keep == slice(0, 3) and left.slots.sum() == 3
    right = local_images(slots, patches, grid, 2, slice(6, 12))  # past the end: the sp padding
    assert torch.equal(right.image_grid_thw, grid[1:]) and torch.equal(right.pixel_values, patches[8:])
    assert right.keep == slice(1, 3) and right.slots.tolist() == [1, 1, 0, 0, 0, 0]
    assert local_images(slots, patches, grid, 2, slice(8, 10)) is None
    with pytest.raises(ValueError, match="2 image slots but its image_grid_thw"):
        local_images(slots[:4].clone(), patches, grid, 2, slice(0, 2))


def test_freeze_vision_keeps_the_tower_bit_identical(vl_model_dir, vl_batch, worker, one_process):
    engine = worker.engine_for(str(vl_model_dir), freeze_vision=True)
    try:
        before = worker.full_weights(engine)
        result = worker.steps(engine, vl_batch, slice(None))
        trained = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
        vision_params = [p for n, p in engine.model.named_parameters() if ".visual." in f".{n}"]
        assert vision_params and not any(id(p) in trained or p.requires_grad for p in vision_params)
    finally:
        engine.destroy()
    after = result["weights"]
    vision = [n for n in before if n.startswith("visual.")]
    text = [n for n in before if not n.startswith("visual.")]
    assert vision and text
    assert all(torch.equal(before[n], after[n]) for n in vision)
    assert all(not torch.equal(before[n], after[n]) for n in text if "layers." in n)
    # Without the freeze the same steps move the tower.
    assert any(not torch.equal(before[n], one_process["weights"][n]) for n in vision)


def assert_ranks_match_one_process(r0: dict, r1: dict, one: dict) -> None:
    """Two ranks' results (each half the rows) against one process on all of them, within 1e-5."""
    assert len(r0["logp"]) == len(r1["logp"]) == 2
    for s0, s1, s in zip(r0["stats"], r1["stats"], one["stats"], strict=True):
        assert s0["loss"] == s1["loss"] and s0["n_seqs"] == s["n_seqs"] == 4
        assert abs(s0["loss"] - s["loss"]) <= 1e-5 and abs(s0["grad_norm"] - s["grad_norm"]) <= 1e-5
    torch.testing.assert_close(torch.cat([r0["logp"], r1["logp"]]), one["logp"], atol=1e-5, rtol=0)
    for n, w in one["weights"].items():
        assert torch.equal(r0["weights"][n], r1["weights"][n])
        torch.testing.assert_close(r0["weights"][n], w, atol=1e-5, rtol=0)


def test_two_ranks_match_one_process(vl_model_dir, tmp_path, worker, one_process):
    assert_ranks_match_one_process(*two_ranks(vl_model_dir, tmp_path), one_process)


@pytest.fixture(scope="module")
def one_process_mixed(vl_model_dir, worker) -> dict:
    return worker.run(str(vl_model_dir), "", mixed=True)


def test_text_only_micro_batch_beside_images_on_another_rank(vl_model_dir, tmp_path, one_process_mixed):
    """Rank 0's first micro-batch is a row without images while rank 1's has images (and the
    ranks' micro-batches differ in image count): the blank-image pass keeps FSDP2's collectives
    in step, and the result is one process's on the same rows."""
    r0, r1 = two_ranks(vl_model_dir, tmp_path, "mixed")
    assert_ranks_match_one_process(r0, r1, one_process_mixed)


@pytest.fixture(scope="module")
def sequence_parallel_ranks(vl_model_dir, tmp_path_factory) -> list[dict]:
    """The mixed scenario with sp_size=2: both ranks compute every micro-batch, each half its tokens."""
    return two_ranks(vl_model_dir, tmp_path_factory.mktemp("vl_sp"), "mixed", "sp")


@pytest.mark.slow
def test_sequence_parallel_ranks_match_one_process(sequence_parallel_ranks, one_process_mixed):
    assert_ranks_match_one_process(*sequence_parallel_ranks, one_process_mixed)


@pytest.mark.slow
def test_sequence_parallel_splits_images_at_the_token_boundary(sequence_parallel_ranks):
    """What each rank's tower ran per micro-batch of the run above: (its image slots, images run,
    features kept). Row 2 (50 tokens, 25 a rank) has its second image's 6 slots at tokens 20-25:
    rank 0 runs both images and keeps 11 features, rank 1 runs the second and keeps its last one.
    Rows 3 and 1 hold their images in rank 0's half (rank 1 runs a blank image); row 0 has none."""
    feeds0, feeds1 = (r["image_feeds"] for r in sequence_parallel_ranks)
    assert feeds0 == [(11, 2, 0, 11), (8, 1, 0, 8), (4, 1, 0, 4), "blank"]
    assert feeds1 == [(1, 1, 5, 6), "blank", "blank", "blank"]


def test_lora_trains_a_vlm(vl_model_dir, vl_batch, hf_model, worker):
    import math

    engine = worker.engine_for(str(vl_model_dir), lora=True)
    try:
        before = worker.full_weights(engine)
        result = worker.steps(engine, vl_batch, slice(None))
        trainable = [n for n, p in engine.model.named_parameters() if p.requires_grad]
    finally:
        engine.destroy()
    assert trainable and all(".lora_" in n for n in trainable)
    assert all(math.isfinite(s["loss"]) for s in result["stats"])
    # Adapters start as a no-op: the first log-probs are the base model's; the steps move the merged weights.
    for b in range(vl_batch["input_ids"].shape[0]):
        n = int(vl_batch["attention_mask"][b].sum())
        torch.testing.assert_close(result["logp"][b, :n], hf_row_logprobs(hf_model, vl_batch, b), atol=1e-5, rtol=0)
    assert any(not torch.equal(before[n], result["weights"][n]) for n in before if "layers." in n)


def test_an_image_pad_the_policy_generated_is_text(vl_model_dir, vl_batch, hf_model, worker):
    """A completion holding ``<|image_pad|>`` (sampled at temperature 1) trains: the pad is an
    ordinary token at a text position, as on the server. Reference: HF's forward from embeddings
    with the image features placed at the prompt's pads only and HF's positions for those slots."""
    pad = hf_model.config.image_token_id
    batch = {k: v.clone() for k, v in vl_batch.items()}
    b, n = 1, int(batch["attention_mask"][1].sum())
    prompt_len = int(batch["loss_mask"][b].int().argmax())
    batch["input_ids"][b, n - 2] = pad  # a generated token
    engine = worker.engine_for(str(vl_model_dir))
    try:
        out = engine.forward(batch, worker.label_logprobs)
        stats = engine.train_batch(batch, lambda head, mb: -head.logprobs(mb["labels"]).mean(), lambda mb: 1.0)
    finally:
        engine.destroy()
    ids = batch["input_ids"][b, :n][None]
    slots = (ids == pad) & (torch.arange(n) < prompt_len)
    grid = batch["image_grid_thw"][b][:1]
    pv = batch["pixel_values"][b, :int(grid.prod())]
    with torch.no_grad():
        emb = hf_model.get_input_embeddings()(ids).clone()
        feats = torch.cat(list(hf_model.model.get_image_features(pv, grid, return_dict=True).pooler_output))
        emb[slots] = feats
        pos, _ = hf_model.model.get_rope_index(ids, mm_token_type_ids=slots.int(), image_grid_thw=grid)
        logits = hf_model(inputs_embeds=emb, position_ids=pos).logits[0].float()
    ref = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    assert int((ids == pad).sum()) == int(slots.sum()) + 1
    torch.testing.assert_close(out[b, 1:n], ref, atol=1e-5, rtol=0)
    assert math.isfinite(stats["loss"]) and stats["grad_norm"] > 0
