"""The model's processor (image processor + tokenizer + chat template), loadable without
torchvision: transformers' Qwen2-VL video processor needs it, images do not; and how many
image tokens its image processor makes of an image of a given size."""

from __future__ import annotations

import os
from collections.abc import Callable

from transformers import Qwen2_5_VLProcessor


class ImageOnlyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
    """Qwen2.5-VL's processor without its video processor (which needs torchvision); a
    module-level class, so that an object holding one can be pickled."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        # The parent passes (image_processor, tokenizer, None) on; the base class pairs its
        # arguments with this signature's sub-processors, so the video slot is never checked.
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def load_processor(model_path: str | os.PathLike):
    """The model's processor (image processor + tokenizer + chat template).

    ``AutoProcessor`` where it can load it. transformers' Qwen2-VL video processor needs
    torchvision; without it (the CPU machines) the same processor class is built without
    the video part from the same files, which renders images identically.
    """
    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return AutoProcessor.from_pretrained(model_path)
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return ImageOnlyQwen2_5_VLProcessor(AutoImageProcessor.from_pretrained(model_path), tokenizer,
                                        chat_template=tokenizer.chat_template)


def image_token_counter(model: str | os.PathLike | object) -> Callable[[int, int], int]:
    """``count(width, height)``: the ``<|image_pad|>`` tokens one image of that size expands into
    with the model's image processor (its resize, patch and merge sizes). ``model``: the model
    directory, or its image processor already loaded."""
    if hasattr(model, "merge_size"):
        ip = model
    else:
        from transformers import AutoImageProcessor

        ip = AutoImageProcessor.from_pretrained(model)
    merge = ip.merge_size

    def count(width: int, height: int) -> int:
        return ip.get_number_of_image_patches(height, width, {}) // (merge * merge)

    return count
