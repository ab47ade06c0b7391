"""An agent written against the OpenAI API only: it imports nothing from arealite.

Trained with `rollout.workflow: agent` and `rollout.workflow_kwargs.run: user_pkg.agent:run`.
"""

import os


async def run(client, item):
    messages = [{"role": "user", "content": item["prompt"]}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    messages.append({"role": "assistant", "content": first.choices[0].message.content})
    messages.append({"role": "user", "content": "Final answer?"})
    final = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    answer = (final.choices[0].message.content or "").strip()
    trace = os.environ.get("USER_PKG_TRACE")
    if trace:
        with open(trace, "a") as f:
            f.write(f"agent {os.environ.get('RANK', '?')}\n")
    # partial credit for the first answer, set on that call alone
    first_right = (first.choices[0].message.content or "").strip() == item["answer"]
    return {"reward": float(answer == item["answer"]), "call_rewards": {first.id: 0.5 * first_right}}
