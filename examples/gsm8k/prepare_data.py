"""Turn GSM8K (the official JSONL: {"question", "answer": "... #### 42"}) into arealite rows.

    python examples/gsm8k/prepare_data.py --input gsm8k/train.jsonl --output data/gsm8k_train.jsonl
    python examples/gsm8k/prepare_data.py --input gsm8k/test.jsonl  --output data/gsm8k_test.jsonl

Each row becomes {"prompt_id", "prompt": [chat messages], "answer": "42"}; with
`data.apply_chat_template: true` the workflow renders the messages with the model's template.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

INSTRUCTION = "Solve the problem step by step. Put the final answer in \\boxed{}."


def convert(src: Path, dst: Path) -> int:
    n = 0
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(src, encoding="utf-8") as f, open(dst, "w", encoding="utf-8") as out:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "question" not in row or "answer" not in row or "####" not in row["answer"]:
                raise ValueError(f"{src}:{lineno}: expected 'question' and an 'answer' ending in '#### N'")
            final = row["answer"].rsplit("####", 1)[1].strip().replace(",", "")
            messages = [{"role": "user", "content": f"{row['question']}\n{INSTRUCTION}"}]
            out.write(json.dumps({"prompt_id": n, "prompt": messages, "answer": final}) + "\n")
            n += 1
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, type=Path)
    p.add_argument("--output", required=True, type=Path)
    args = p.parse_args()
    print(f"wrote {convert(args.input, args.output)} rows to {args.output}")


if __name__ == "__main__":
    main()
