"""Vision-language prompts: images in (paths, bytes, base64), the processor's tensors out.

The one home of the image basics every room uses (docs/vision.md). ``image_io``: read, check
and decode one image, encode it for a request (`ImageError` names where an image is).
``prompt``: the ``<image>`` placeholders, and chat messages with images rendered through the
model's processor into a `VisionPrompt` (the expanded token ids, pixel values, grid sizes and
the base64 images a request carries). ``processor``: loading it, and the image tokens of an
image's size. ``dataset_checks``: a dataset's images checked before a run.
"""
