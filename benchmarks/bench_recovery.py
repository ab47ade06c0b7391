"""Cost of recovering a killed run: restart-to-first-step time and work lost per kill.

A short demo run (launcher + embedded server + 2-rank torchrun trainer, micro model)
is SIGKILLed (its trainer workers) at a random moment N times; each time the same
command is re-run and resumes from the latest complete checkpoint. Measured:

- restart to first new training step (launch -> first step record of the new run),
  against the baseline: a fresh start's launch -> first step, in the same session;
- steps lost per kill: last step the killed run recorded minus the step it resumes at;
- the per-prompt accounting over all kills, closed by a last re-run that finishes the
  run: per epoch, no prompt trained twice and none missing.

    python benchmarks/bench_recovery.py [--kills 10] [--quick] [--freq-steps 3]

Prints a table, then one JSON line with the figures (the last line).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from arealite.utils import accounting  # noqa: E402
from arealite.utils.procs import trainer_workers  # noqa: E402

N_PROMPTS, BATCH = 64, 8  # the demo's train set and rollout.consumer_batch_size: 8 steps per epoch


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def _latest_run(stats: Path) -> tuple[int | None, list[dict]]:
    """(start step, step records) of the latest run in the stats file."""
    if not stats.exists():
        return None, []
    recs = []
    for line in stats.read_text().splitlines():
        try:
            recs.append(json.loads(line))
        except ValueError:
            continue
    starts = [i for i, r in enumerate(recs) if accounting.START in r]
    if not starts:
        return None, []
    mine = recs[starts[-1]:]
    return int(mine[0][accounting.START]), [r for r in mine if accounting.IDS in r]


class Bench:
    def __init__(self, demo: Path, out: Path, freq_steps: int, max_steps: int, rng: random.Random):
        self.demo, self.out, self.freq, self.max_steps, self.rng = demo, out, freq_steps, max_steps, rng
        out.mkdir(parents=True, exist_ok=True)

    def cmd(self, trial: str, mode: str) -> list[str]:
        d = self.demo
        return [sys.executable, "-m", "arealite.launcher.local", "examples/rlvr/train.py",
                "--config", "examples/reverse_digits/config.yaml", f"experiment.output_root={self.out}",
                f"experiment.trial={trial}", f"actor.model_path={d / 'model'}",
                f"data.train_path={d / 'train.jsonl'}", "data.eval_path=null", "evaluation.freq_steps=null",
                "evaluation.max_prompts=null", "launch.n_trainer_procs=2", f"rollout.consumer_batch_size={BATCH}",
                "generation.n_samples=2", f"saver.freq_steps={self.freq}", "saver.keep_last=2",
                "saver.export_hf_at_end=false", f"data.max_train_steps={self.max_steps}",
                "stats.progress_bar=false", "stats.plot=false", f"recover.mode={mode}"]

    def run_and_kill(self, trial: str, mode: str) -> dict:
        """Launch, wait for the first step, run a random number of steps more, SIGKILL the workers."""
        stats = self.out / "reverse_digits" / trial / "stats.jsonl"
        log = open(self.out / f"{trial}.log", "a")
        t0 = time.time()
        p = subprocess.Popen(self.cmd(trial, mode), cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            first = start = None
            extra = self.rng.randint(1, 2 * self.freq)
            deadline = time.monotonic() + 400
            while time.monotonic() < deadline:
                if p.poll() is not None:
                    raise RuntimeError(f"run exited early ({p.returncode}); see {log.name}")
                start, steps = _latest_run(stats)
                fresh = [r for r in steps if r["time"] >= t0]
                if fresh and first is None:
                    first = fresh[0]
                if first is not None and max(r["step"] for r in fresh) >= first["step"] + extra - 1:
                    break
                time.sleep(0.02)
            else:
                raise RuntimeError(f"no progress within 400 s; see {log.name}")
            time.sleep(self.rng.uniform(0.0, 0.3))  # before, during or after a checkpoint
            for pid in trainer_workers(p.pid):
                os.kill(pid, signal.SIGKILL)
            p.wait(120)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
        _, steps = _latest_run(stats)
        return {"start_step": start, "first_step_s": first["time"] - t0,
                "last_step": max(r["step"] for r in steps)}

    def finish(self, trial: str) -> float:
        """Re-run the command and let the run end; return how long that took."""
        t0 = time.time()
        with open(self.out / f"{trial}.log", "a") as log:
            code = subprocess.run(self.cmd(trial, "auto"), cwd=REPO, env=_env(), stdout=log,
                                  stderr=subprocess.STDOUT, timeout=1200).returncode
        if code != 0:
            raise RuntimeError(f"the last run exited with {code}; see {log.name}")
        return time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--fresh", type=int, default=2, help="fresh starts measured as the baseline")
    ap.add_argument("--freq-steps", type=int, default=3, help="saver.freq_steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--demo-dir", type=Path, help="reuse a demo built by prepare.py (micro, 64 prompts)")
    ap.add_argument("--quick", action="store_true", help="2 kills, 1 fresh start")
    a = ap.parse_args()
    if a.quick:
        a.kills, a.fresh = 2, 1
    rng = random.Random(a.seed)
    tmp = Path(tempfile.mkdtemp(prefix="bench_recovery_"))
    demo = a.demo_dir
    if demo is None:
        demo = tmp / "demo"
        subprocess.run([sys.executable, "examples/reverse_digits/prepare.py", "--out", str(demo), "--size", "micro",
                        "--n-train", str(N_PROMPTS), "--n-eval", "8", "--warmup-steps", "5", "--batch-size", "16"],
                       cwd=REPO, env=_env(), check=True, capture_output=True)
    # Each killed run ends at most 2*freq (+ the steps of a random 0.3 s) past where it
    # resumed, so no killed run reaches the end; the last run finishes whole epochs.
    per_epoch = N_PROMPTS // BATCH
    max_steps = math.ceil((a.kills + 1) * (2 * a.freq_steps + 2) / per_epoch) * per_epoch
    b = Bench(demo, tmp / "runs", a.freq_steps, max_steps, rng)

    fresh = [b.run_and_kill(f"fresh{i}", "disabled")["first_step_s"] for i in range(a.fresh)]
    rows = []
    prev = b.run_and_kill("killed", "auto")  # the run that gets killed over and over
    for _ in range(a.kills):
        cur = b.run_and_kill("killed", "auto")
        rows.append({"killed_at": prev["last_step"], "resumed_at": cur["start_step"],
                     "lost_steps": prev["last_step"] - cur["start_step"], "restart_first_step_s": cur["first_step_s"]})
        prev = cur
    final_s = b.finish("killed")
    acc = accounting.prompt_accounting(tmp / "runs" / "reverse_digits" / "killed" / "stats.jsonl",
                                       expected_ids=range(N_PROMPTS))
    dup = sum(len(r.duplicated) for r in acc.epochs.values())
    missing = sum(len(r.missing) for r in acc.epochs.values())
    epochs = sum(bool(r.handed_out) for r in acc.epochs.values())

    print(f"fresh start -> first step: {', '.join(f'{s:.1f}s' for s in fresh)}  (baseline)")
    print(f"{'kill':>4} {'killed at':>9} {'resumed at':>10} {'lost steps':>10} {'restart->1st step':>17}")
    for i, r in enumerate(rows, 1):
        print(f"{i:>4} {r['killed_at']:>9} {r['resumed_at']:>10} {r['lost_steps']:>10} "
              f"{r['restart_first_step_s']:>16.1f}s")
    restart = [r["restart_first_step_s"] for r in rows]
    lost = [r["lost_steps"] for r in rows]
    base = statistics.mean(fresh)
    print(f"restart->first step: mean {statistics.mean(restart):.1f}s vs fresh {base:.1f}s "
          f"({statistics.mean(restart) / base:.2f}x); lost steps per kill: mean {statistics.mean(lost):.2f}, "
          f"max {max(lost)} (saver.freq_steps={a.freq_steps})")
    print(f"last run to step {max_steps}: {final_s:.1f}s; over {epochs} epochs x {N_PROMPTS} prompts: "
          f"trained twice {dup}, missing {missing}")
    print(json.dumps({
        "bench": "recovery", "kills": a.kills, "freq_steps": a.freq_steps, "seed": a.seed,
        "fresh_first_step_s": round(base, 2),
        "restart_first_step_s_mean": round(statistics.mean(restart), 2),
        "restart_first_step_s_max": round(max(restart), 2),
        "restart_over_fresh": round(statistics.mean(restart) / base, 3),
        "lost_steps_mean": round(statistics.mean(lost), 2), "lost_steps_max": max(lost),
        "max_steps": max_steps, "final_run_s": round(final_s, 1), "epochs_checked": epochs,
        "prompts_trained_twice": dup, "prompts_missing": missing, "steps_counted": len(acc.steps),
    }))


if __name__ == "__main__":
    main()
