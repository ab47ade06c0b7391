"""What the OpenAI-compatible endpoint costs per LLM call, model time excluded.

An in-process engine answers ``agenerate`` at once (a fixed 16-token reply), so what is
measured is the agent path's own overhead: the ``openai`` client, HTTP on 127.0.0.1, the
endpoint (session lookup, validation, incremental chat rendering, tool parsing, response
shaping) and building the rows. Baseline: a hand-written workflow that renders the same
conversation token-in/token-out (`user_turn_piece`) and calls ``agenerate`` directly.
Both run the same 4-turn conversation, ``n`` episodes at once, on one event loop.

    python benchmarks/bench_agent.py [--episodes 64] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arealite.api.types import Completion, GenerationRequest  # noqa: E402
from arealite.config.agent import AgentConfig  # noqa: E402
from arealite.config.schema import GenerationConfig  # noqa: E402
from arealite.agent.workflow import AgentWorkflow  # noqa: E402
from arealite.workflow.base import pad_and_stack, trajectory_row  # noqa: E402
from arealite.workflow.common import user_turn_piece  # noqa: E402

TURNS = 4


class InstantEngine:
    def __init__(self, tok):
        self.reply = tok.encode("The answer is 408, computed with care.", add_special_tokens=False)[:15]
        self.reply.append(tok.convert_tokens_to_ids("<|im_end|>"))

    async def agenerate(self, req: GenerationRequest) -> Completion:
        n = len(self.reply)
        return Completion(req.rid, req.input_ids, list(self.reply), [-0.1] * n, [0] * n, "stop")


async def agent(client, item):
    messages = [{"role": "user", "content": item["prompt"]}]
    for t in range(TURNS):
        r = await client.chat.completions.create(model="p", messages=messages)
        messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"more {t}"}]
    return 1.0


async def direct(tok, engine, item, sampling):
    text = tok.apply_chat_template([{"role": "user", "content": item["prompt"]}], add_generation_prompt=True,
                                   tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    prompt, pieces = list(ids), []
    for t in range(TURNS):
        c = await engine.agenerate(GenerationRequest(list(ids), sampling))
        pieces.append((c.output_ids, c.output_logprobs, c.output_versions))
        ids += c.output_ids
        if t + 1 < TURNS:
            p = user_turn_piece(tok, f"more {t}", after=c.output_ids)
            pieces.append((p, None, None))
            ids += p
    return pad_and_stack([trajectory_row(prompt, pieces)])


async def measure(fn, items, concurrency):
    sem = asyncio.Semaphore(concurrency)

    async def one(it):
        async with sem:
            return await fn(it)

    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(one(it) for it in items))
    return time.perf_counter() - t0, time.process_time() - c0


async def main_async(args) -> dict:
    from transformers import AutoTokenizer

    from arealite.models.tiny import build_tiny_model
    from arealite.workflow.common import sampling_from_config

    tok = AutoTokenizer.from_pretrained(build_tiny_model(tempfile.mkdtemp(), size="micro"))
    gen = GenerationConfig(n_samples=1, max_new_tokens=16)
    engine = InstantEngine(tok)
    wf = AgentWorkflow(agent, tokenizer=tok, generation=gen, agent=AgentConfig())
    items = [{"prompt": f"What is 12 * {i}?", "prompt_id": i} for i in range(args.episodes)]
    await wf.arun_episode(engine, items[0])  # start the endpoint, warm up
    sampling = sampling_from_config(gen, tok)
    out = {}
    for name, fn in (("direct", lambda it: direct(tok, engine, it, sampling)),
                     ("agent_endpoint", lambda it: wf.arun_episode(engine, it))):
        wall, cpu = await measure(fn, items, args.concurrency)
        calls = args.episodes * TURNS
        out[name] = {"wall_s": round(wall, 3), "cpu_ms_per_call": round(1000 * cpu / calls, 3),
                     "calls_per_s": round(calls / wall, 1)}
    out["overhead_ratio_cpu"] = round(out["agent_endpoint"]["cpu_ms_per_call"] / out["direct"]["cpu_ms_per_call"], 2)
    await wf._ep.aclose()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    print(json.dumps(asyncio.run(main_async(p.parse_args())), indent=2))


if __name__ == "__main__":
    main()
