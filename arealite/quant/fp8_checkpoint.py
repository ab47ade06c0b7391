"""Write a block-FP8 copy of a Hugging Face checkpoint, for SGLang FP8 servers.

SGLang keeps 128x128 block scales (``weight_scale_inv``) only for a checkpoint that is
FP8-serialised: its ``config.json`` carries ``quantization_config: {quant_method: fp8,
activation_scheme: dynamic, weight_block_size: [128, 128]}``. Launched from a bf16
checkpoint with ``--quantization fp8`` it quantises per channel instead, and the trainer's
block pushes would not fit (docs/sglang.md, "FP8 weights"). So an FP8 run on SGLang serves
from such a copy (``server.model_path``):

    python -m arealite.quant.fp8_checkpoint SRC_DIR DST_DIR

Every file besides the weights (tokenizer, generation config) is copied as it is.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from arealite.quant.fp8 import BLOCK, fp8_checkpoint_tensors

QUANTIZATION_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}


def write_fp8_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """Copy the HF directory `src` to `dst` with its matmul weights block-quantised (FP8 + scales)."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    files = sorted(src.glob("*.safetensors"))
    if not files or not (src / "config.json").is_file():
        raise ValueError(f"{src} is not a Hugging Face model directory (config.json and *.safetensors)")
    dst.mkdir(parents=True, exist_ok=False)
    weight_map: dict[str, str] = {}
    for f in files:
        out = {n: t.contiguous() for name, w in load_file(str(f)).items()
               for n, t in fp8_checkpoint_tensors(name, w)}
        save_file(out, str(dst / f.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, f.name))
    for other in src.iterdir():
        if other.is_file() and other.suffix != ".safetensors" and other.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(other, dst / other.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = dict(QUANTIZATION_CONFIG)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    if len(files) > 1:
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Write a block-FP8 (128x128 e4m3) copy of a Hugging Face checkpoint.")
    p.add_argument("src")
    p.add_argument("dst")
    args = p.parse_args(argv)
    print(write_fp8_checkpoint(args.src, args.dst))


if __name__ == "__main__":
    main()
