"""Vision-language prompts: images in (paths, bytes, base64), the processor's tensors out.

``images``: load and check one image, encode it for a request. ``prompt``: render chat
messages with images through the model's processor into a `VisionPrompt` (the expanded
token ids, pixel values, grid sizes and the base64 images a request carries). See docs/vision.md.
"""
