"""Images on the embedded server: a Qwen2.5-VL model runs ``/generate`` with ``image_data``.

The request's ``input_ids`` hold each image as a run of ``<|image_pad|>``: the processor's expanded
prompt (one pad per merged patch, as `arealite.vision.prompt` renders it), or one pad per image,
which this server expands from the image's grid as SGLang's processor does (docs/sglang.md, Images);
any other run length is refused. For each prompt with images this module decodes them (base64 or ``data:`` URLs, never
server paths), caps their bytes and pixels, runs the model's own image processor, checks the ids'
image blocks against the images, and computes the row's 3-D rope positions. The runner then
prefills the row with ``pixel_values`` + ``image_grid_thw`` and those positions; during decode the
three rope components of a Qwen2.5-VL token are all ``text position + rope delta``, so the row's
ordinary 1-D position plus its delta is all decode needs (HF expands 2-D position ids to 3 equal
components). The prompt cache keys a row on the hash of its image bytes (`VisionInputs.key`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass

import torch

from arealite.utils.json_types import JsonObject, JsonValue
from arealite.vision.placeholders import count_block_placeholders, image_slots

from .generate_request import GenerateInput, RequestError

#: Default caps on one image: encoded bytes and decoded pixels (checked from the header).
MAX_IMAGE_BYTES = 32 << 20
MAX_IMAGE_PIXELS = 4096 * 4096
#: Model types whose vision tower this server runs.
VISION_MODEL_TYPES = ("qwen2_5_vl",)


def is_vision_config(cfg) -> bool:
    return getattr(cfg, "model_type", None) in VISION_MODEL_TYPES


def load_vision_model(model_path: str, dtype: torch.dtype):
    """The VLM (vision tower + language model), as a hub model loads."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=dtype)
    count_block_placeholders(model)  # a pad the policy generated is text, as to SGLang
    return model


@dataclass
class VisionInputs:
    """What the runner needs for one prompt with images."""

    pixel_values: torch.Tensor  # [P, D] float32
    image_grid_thw: torch.Tensor  # [N, 3] int64
    positions: torch.Tensor  # [3, L] the prompt's rope positions
    rope_delta: int  # decode position = text position + rope_delta
    key: bytes  # hash of the images' bytes: the prompt cache's key


def _image_runs(ids: list[int], image_token_id: int, vision_start_id: int) -> list[tuple[int, int]]:
    """The image slots' runs (`vision.placeholders.image_slots`: pads of a ``<|vision_start|>``
    block; a pad elsewhere, e.g. generated, is text), one per image: ``(start, length)`` each."""
    slots = image_slots(torch.tensor(ids, dtype=torch.long), image_token_id, vision_start_id).tolist()
    runs: list[tuple[int, int]] = []
    for i, slot in enumerate(slots):
        if not slot:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def expand_image_runs(ids: list[int], image_token_id: int, vision_start_id: int, grid: torch.Tensor, merge: int,
                      where: str) -> list[int]:
    """``ids`` with every image's run of pads ``t*h*w / merge**2`` long (from ``grid [N, 3]``):
    a run of one pad is expanded, a run already that long is kept, any other is refused."""
    out, prev = [], 0
    for j, ((start, n), thw) in enumerate(zip(_image_runs(ids, image_token_id, vision_start_id), grid.tolist(),
                                              strict=True)):
        need = thw[0] * thw[1] * thw[2] // (merge * merge)
        if n not in (1, need):
            raise RequestError(f"{where}[{j}]: the image's block holds {n} <|image_pad|> tokens; its grid "
                               f"{thw} needs {need} (or send one pad per image and the server expands it)")
        out += ids[prev:start] + [image_token_id] * need
        prev = start + n
    return out + ids[prev:]


class VisionSupport:
    """Decodes and checks a request's ``image_data`` and feeds the runner's prefill."""

    def __init__(self, model_path: str, hf_config, *, max_image_bytes: int = MAX_IMAGE_BYTES,
                 max_image_pixels: int = MAX_IMAGE_PIXELS, context_length: int = 1 << 20):
        from arealite.vision.processor import load_processor

        self.config = hf_config
        self.image_processor = load_processor(model_path).image_processor
        self.image_token_id = int(hf_config.image_token_id)
        self.vision_start_id = int(hf_config.vision_start_token_id)
        self.max_image_bytes = max_image_bytes
        self.max_image_pixels = max_image_pixels
        self.context_length = context_length

    # -- request side (off the model thread) ------------------------------

    @staticmethod
    def take_image_data(body: JsonObject) -> JsonValue:
        """Remove ``image_data`` from the body (parse_generate refuses it for text-only models)."""
        return body.pop("image_data", None)

    def per_prompt(self, image_data: JsonValue, n: int, batch: bool) -> list[list[str]]:
        """SGLang's forms: one image or a list for one prompt; one list (or image, or null) per prompt."""
        if image_data is None:
            return [[] for _ in range(n)]
        if not batch:
            items = [image_data]
        elif not isinstance(image_data, list) or len(image_data) != n:
            raise RequestError(f"image_data: a batch of {n} prompts needs a list of {n} image lists")
        else:
            items = image_data
        out = []
        for i, v in enumerate(items):
            where = f"image_data[{i}]" if batch else "image_data"
            v = [] if v is None else [v] if isinstance(v, str) else v
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                raise RequestError(f"{where} must be a list of base64 images or data URLs")
            out.append(v)
        return out

    def attach(self, inputs: list[GenerateInput], image_data: JsonValue, batch: bool) -> None:
        """Set ``inp.vision`` of every prompt with images, its ids expanded (one pad per merged
        patch); a RequestError names the field."""
        lists = self.per_prompt(image_data, len(inputs), batch)
        for i, (inp, images) in enumerate(zip(inputs, lists)):
            where = f"image_data[{i}]" if batch else "image_data"
            inp.vision, ids = self.prepare(inp.input_ids, images, where)
            if len(ids) + inp.sampling.max_new_tokens > self.context_length:
                raise RequestError(f"{where}: with its images the prompt is {len(ids)} tokens, plus max_new_tokens "
                                   f"({inp.sampling.max_new_tokens}) over the context length {self.context_length}; "
                                   "lower max_new_tokens or send fewer or smaller images")
            inp.input_ids = ids

    def _decode(self, text: str, where: str):
        from arealite.vision.image_io import ImageError, open_image

        if text.startswith("data:"):
            head, sep, text = text.partition(",")
            if not sep or not head.endswith(";base64"):
                raise RequestError(f"{where}: a data URL must be base64 ('data:image/png;base64,...')")
        if len(text) * 3 // 4 > self.max_image_bytes:
            raise RequestError(f"{where}: {len(text) * 3 // 4} bytes exceed the cap of {self.max_image_bytes} per image")
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(f"{where}: not valid base64 (the server never reads image paths)") from None
        try:
            return open_image(data, where, self.max_image_pixels), data
        except ImageError as e:
            raise RequestError(f"{e} (cap: {self.max_image_pixels} pixels per image)") from None

    def prepare(self, ids: list[int], images: list[str], where: str) -> tuple[VisionInputs | None, list[int]]:
        """Decode and check one prompt's images: their inputs (None for a prompt without image
        tokens or images) and the prompt's ids with every image's pads expanded."""
        from arealite.vision.rope import mrope_positions

        blocks = len(_image_runs(ids, self.image_token_id, self.vision_start_id))
        if blocks != len(images):
            raise RequestError(f"{where}: the prompt's input_ids hold {blocks} image block(s) but {len(images)} "
                               "image(s) were sent; send one image per <|vision_start|><|image_pad|>... block")
        if not images:
            return None, ids
        decoded = [self._decode(t, f"{where}[{j}]") for j, t in enumerate(images)]
        h = hashlib.sha256()
        for _, data in decoded:
            h.update(hashlib.sha256(data).digest())
        out = self.image_processor(images=[img for img, _ in decoded], return_tensors="pt")
        grid = out["image_grid_thw"].to(torch.int64)
        ids = expand_image_runs(ids, self.image_token_id, self.vision_start_id, grid,
                                self.config.vision_config.spatial_merge_size, where)
        t = torch.tensor(ids, dtype=torch.long)
        try:
            pos = mrope_positions(self.config, t, grid)
        except ValueError as e:
            raise RequestError(f"{where}: {e}") from None
        delta = int(pos.max()) + 1 - len(ids)
        return VisionInputs(pixel_values=out["pixel_values"].to(torch.float32), image_grid_thw=grid,
                            positions=pos, rope_delta=delta, key=h.digest()), ids


# -- runner side (the model thread) ------------------------------------------


def prompt_key(inp: GenerateInput) -> bytes | None:
    v = getattr(inp, "vision", None)
    return None if v is None else v.key


def rope_deltas(seqs) -> list[int]:
    return [s.inp.vision.rope_delta if getattr(s.inp, "vision", None) is not None else 0 for s in seqs]


def prefill_inputs(seqs, positions: torch.Tensor, lens: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, dict]:
    """3-D positions ``[3, B, T]`` and the image tensors of a left-padded prefill of ``seqs``; the
    plain ``positions [B, T]`` and no extras when no row has images."""
    vis = [getattr(s.inp, "vision", None) for s in seqs]
    if all(v is None for v in vis):
        return positions, {}
    T = positions.shape[1]
    pos3 = positions[None].expand(3, -1, -1).clone()
    for i, v in enumerate(vis):
        if v is not None:
            pos3[:, i, T - lens[i]:] = v.positions.to(pos3.device)
    rows = [v for v in vis if v is not None]
    dev = positions.device
    return pos3, {"pixel_values": torch.cat([v.pixel_values for v in rows]).to(dev, dtype),
                  "image_grid_thw": torch.cat([v.image_grid_thw for v in rows]).to(dev)}
