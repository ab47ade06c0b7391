"""Part (a) of bench_scale.py: AReaL's setup simulated, synchronous against asynchronous RL.

Each run is a whole ``python -m arealite.train``: simulated inference servers
(``launch.server_backend: sim``) and the simulated train engine (``actor.backend: sim``),
everything else real (RLTrainer, controller, client, RLVR workflow and its reward, the
staleness bound, the weight publisher). One run per ``max_head_offpolicyness`` eta in
0, 1, 2, 4, 8 with the same seed, prompts and cost model. Throughput is training steps per
second of wall time over the steps after the first ``--skip``; the speed-up is its ratio to
eta = 0.

The bound is what the same cost model allows with perfect overlap: from the eta = 0 run,
a step is generation (the trainer's wait for its batch) plus training and the weight push;
overlapped, it is the longer of the two. ``bound = (gen + train) / max(gen, train)``.
It assumes servers that never idle, which the staleness bound does not allow: *attainable* is the
same run played in virtual time with free orchestration (`arealite.sim.pipeline`: the servers'
cost model, the staleness bound, the groups' tails and the trainer's measured seconds, nothing
else), the fastest any orchestration could go; *of att.* is the measured speed-up over it.

GPU split as AReaL's paper (arXiv 2505.24298): three generation GPUs for one training GPU,
H800s, a 1.5B model; the batch and the answer lengths are scaled down so that the
orchestration fits two CPU cores (docs/scale.md).

The servers' running rows are sampled (``/server_info``) through each run: *rows busy* is their
mean over the measured steps as a share of every server's ``max_batch_size`` rows (the bound's
never-idle generation is 1.0); *ready* the groups finished and waiting for the trainer at the
push (``controller/output_queue``), which hold part of the staleness budget.

Every pause mode (``--pause-modes``: abort, retract, in_place; ``weight_sync.pause_mode``) and
eta runs ``--repeats`` times (interleaved); one table per mode gives medians with [min-max], the
push's paused time and client CPU (``weight_sync/*`` stats), and the orchestration's CPU per step
(every process of the run, read from /proc) and per trajectory. JSON: ``eta4_of_bound_<mode>``,
``eta4_of_attainable_<mode>``.

    python benchmarks/scale_overlap.py [--quick] [--etas 0,1,2,4,8] [--repeats 3] [--eta0-once]
        [--a-max-concurrent 64]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SERVER_ROWS = 64  # server.max_batch_size (default): the rows one simulated server decodes at once
PAPER_SPEEDUP = 2.77  # AReaL's abstract: "up to 2.77x" over synchronous systems on the same GPUs


def prepare_demo(work: Path, n_train: int) -> Path:
    out = work / "demo"
    subprocess.run([sys.executable, "examples/reverse_digits/prepare.py", "--out", str(out), "--size", "micro",
                    "--n-train", str(n_train), "--n-eval", "8", "--warmup-steps", "5", "--batch-size", "8"],
                   cwd=REPO, check=True, capture_output=True, timeout=600,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    return out


def run_config(args, demo: Path, runs: Path, eta: int, mode: str) -> dict:
    return {
        "experiment": {"name": "overlap", "trial": f"eta{eta}", "output_root": str(runs), "seed": 1},
        "launch": {"n_servers": args.gen_gpus, "n_trainer_procs": 1, "server_backend": "sim"},
        "server": {"context_length": 32768, "sim": {"gpu": "h100", "model": args.model, "time_scale": args.a_time_scale,
                           "length_median": args.a_length_median, "length_sigma": 1.0}},
        "rollout": {"consumer_batch_size": args.batch, "max_head_offpolicyness": eta,
                    "max_concurrent_rollouts": args.a_max_concurrent},
        "generation": {"n_samples": args.n_samples, "max_new_tokens": args.a_max_new_tokens},
        "actor": {"model_path": str(demo / "model"), "backend": "sim",
                  "sim": {"gpu": "h800", "model": args.model, "n_gpus": args.train_gpus, "mfu": args.mfu}},
        "data": {"train_path": str(demo / "train.jsonl"), "eval_path": None,
                 "reward_fn": "arealite.reward.reverse_digits:reverse_digits_reward",
                 "max_train_steps": args.steps},
        "evaluation": {"freq_steps": None},
        "saver": {"export_hf_at_end": False, "freq_steps": None},
        "stats": {"progress_bar": False, "plot": False},
        "weight_sync": {"bucket_size_mb": 1, "probe": False, "pause_mode": mode},
    }


def _role(cmdline: bytes) -> str | None:
    if b"arealite.server" in cmdline or b"arealite.sim" in cmdline:
        return "servers"
    if b"rollout.worker" in cmdline:
        return "rollout_worker"
    if b"arealite.train" in cmdline or b"torch.distributed.run" in cmdline:
        return "trainer"
    return None


def _tree_cpu(root: int) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of ``root`` and its descendants, by pid, with their role."""
    parent, stat = {}, {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        parent[int(d)] = int(fields[1])
        stat[int(d)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    tree, out = {root}, {}
    for _ in range(6):  # the launcher, torchrun, the trainer, its rollout worker: a few levels deep
        tree |= {pid for pid, pp in parent.items() if pp in tree}
    for pid in tree:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                role = _role(f.read())
        except OSError:
            continue
        if role is not None and pid in stat:
            out[pid] = (role, stat[pid])
    return out


class CpuSampler:
    """Samples the CPU time of a run's processes (servers, trainer, rollout worker) every
    ``period`` seconds, so that the CPU spent between two steps can be read afterwards."""

    def __init__(self, root: int, period: float = 0.2):
        self.root, self.period = root, period
        self.samples: list[tuple[float, dict[int, tuple[str, float]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            self.samples.append((time.time(), _tree_cpu(self.root)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds by role from the sample nearest ``t0`` to the one nearest ``t1``."""
        a = min(self.samples, key=lambda x: abs(x[0] - t0))[1]
        b = min(self.samples, key=lambda x: abs(x[0] - t1))[1]
        out = {"servers": 0.0, "trainer": 0.0, "rollout_worker": 0.0}
        for pid, (role, cpu) in b.items():
            out[role] += cpu - a.get(pid, (role, 0.0))[1]
        return out


class RowSampler:
    """Samples the simulated servers' running rows (``/server_info``: ``num_running_reqs``) every
    ``period`` seconds; the servers' ports are read from the launcher's log as they start."""

    def __init__(self, log: Path, n_servers: int, period: float = 0.25):
        self.log, self.n_servers, self.period = log, n_servers, period
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _ports(self) -> list[str]:
        try:
            return re.findall(r"started server\d+ \(pid \d+\) on 127\.0\.0\.1:(\d+)", self.log.read_text())
        except OSError:
            return []

    def _loop(self) -> None:
        ports: list[str] = []
        while not self._stop.wait(self.period):
            ports = ports if len(ports) >= self.n_servers else self._ports()
            if len(ports) < self.n_servers:
                continue
            try:
                rows = sum(json.load(urllib.request.urlopen(f"http://127.0.0.1:{p}/server_info", timeout=2))
                           ["internal_states"][0]["num_running_reqs"] for p in ports)
            except (OSError, ValueError, KeyError):  # not up yet, or shutting down
                continue
            self.samples.append((time.time(), rows))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def mean_between(self, t0: float, t1: float) -> float:
        """Mean running rows over all servers between ``t0`` and ``t1`` (0 if none sampled)."""
        rows = [r for t, r in self.samples if t0 <= t <= t1]
        return statistics.mean(rows) if rows else 0.0


def one_run(args, demo: Path, work: Path, eta: int, rep: int = 0, mode: str = "in_place") -> dict:
    runs = work / f"runs_{mode}_eta{eta}_{rep}"
    cfg_path = work / f"{mode}_eta{eta}.yaml"
    cfg_path.write_text(yaml.safe_dump(run_config(args, demo, runs, eta, mode)))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log = work / f"{mode}_eta{eta}_{rep}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "arealite.train", "--config", str(cfg_path)], cwd=work,
                                env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        sampler, rows = CpuSampler(proc.pid), RowSampler(log, args.gen_gpus)
        try:
            rc = proc.wait(timeout=1800)
        finally:
            sampler.stop()
            rows.stop()
    if rc != 0:
        raise RuntimeError(f"{mode} eta={eta}: the run failed\n{log.read_text()[-4000:]}")
    recs = [json.loads(x) for x in (runs / "overlap" / f"eta{eta}" / "stats.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "time/step_s" in r and "rollout/prompt_ids" in r]
    kept = steps[args.skip:]
    start = steps[args.skip - 1]["time"] if args.skip else kept[0]["time"]
    span = kept[-1]["time"] - start
    n = len(kept) if args.skip else len(kept) - 1
    med = lambda k: statistics.median(r.get(k, 0.0) for r in kept)
    cpu = {k: v / n for k, v in sampler.between(start, kept[-1]["time"]).items()}
    return {"eta": eta, "steps_per_s": n / span, "step_s": span / n, "gen_s": med("time/rollout_wait_s"),
            "train_s": med("time/train_s") + med("time/weight_sync_s"), "push_s": med("time/weight_sync_s"),
            "push_paused_s": med("weight_sync/pause_s") + med("weight_sync/transfer_s") + med("weight_sync/verify_s")
            + med("weight_sync/continue_s"), "push_client_cpu_s": med("weight_sync/total_client_cpu_s"),
            "staleness_max": max(r["rollout/staleness_max"] for r in kept),
            "answer_len": med("rollout/response_len_mean"),
            "seq_len": med("rollout/n_tokens") / max(1.0, med("rollout/n_trajectories")),
            "cpu_per_step": cpu,
            "rows_busy": rows.mean_between(start, kept[-1]["time"]) / (args.gen_gpus * SERVER_ROWS),
            "ready_groups": med("controller/output_queue"),
            # Per step: a batch held, with enough groups ready, for a running group that the
            # staleness bound makes it take (a cumulative counter, read at each push).
            "overdue_wait_s": (kept[-1].get("controller/overdue_wait_s", 0.0)
                               - (steps[args.skip - 1] if args.skip else kept[0]).get("controller/overdue_wait_s", 0.0)) / n}


def busy_generation_s(args, answer_len: float, seq_len: float) -> float:
    """Real seconds the generation servers take for one batch's tokens when never idle: every
    server decoding a full batch (``server.max_batch_size`` = 64 rows), under the servers' own
    cost model (`SimSpec`)."""
    from arealite.sim.cost_model import SimSpec
    from arealite.sim.pipeline import busy_generation_s as busy

    spec = SimSpec(gpu="h100", model=args.model, time_scale=args.a_time_scale)
    return busy(spec, args.gen_gpus, SERVER_ROWS, args.batch * args.n_samples, answer_len, seq_len)


def attainable_step_s(args, eta: int, sync: list[dict], mode: str = "in_place", seeds: int = 5) -> float:
    """Median seconds per step (over ``seeds`` length draws) of the same run played in virtual time
    with free orchestration (`arealite.sim.pipeline`): the servers' cost model, the staleness
    bound and the group tails; from the eta = 0 runs, the mean answer length, the push's seconds
    and the training seconds per token (a batch of long groups trains longer)."""
    from arealite.sim.cost_model import SimSpec
    from arealite.sim.pipeline import PipelineSetup, median_for_mean, simulate_pipeline

    med = lambda k: statistics.median(r[k] for r in sync)
    # The run's answers as long on average as the eta = 0 runs measured (a few hundred answers
    # differ from the distribution's mean by a few percent, and the step follows them).
    median = median_for_mean(med("answer_len"), 1.0, args.a_max_new_tokens)
    per_step = args.batch * args.n_samples
    spec = SimSpec(gpu="h100", model=args.model, time_scale=args.a_time_scale,
                   length_median=median, length_sigma=1.0)
    steps = []
    for seed in range(seeds):
        setup = PipelineSetup(spec, n_servers=args.gen_gpus, rows_per_server=SERVER_ROWS, batch_groups=args.batch,
                              group_size=args.n_samples, eta=eta, max_concurrent=args.a_max_concurrent,
                              max_new_tokens=args.a_max_new_tokens,
                              prompt_tokens=max(1, round(med("seq_len") - med("answer_len"))),
                              train_s=0.0, push_s=med("push_s"), seed=seed, pause_mode=mode,
                              train_s_per_token=(med("train_s") - med("push_s")) / (per_step * med("seq_len")))
        steps.append(simulate_pipeline(setup, args.steps, args.skip).step_s(args.skip))
    return statistics.median(steps)


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def _cpu_row(runs: list[dict], per_step_trajectories: int) -> dict[str, float]:
    """Median orchestration CPU per step over the repeats: by role, total, per trajectory."""
    out = {role: statistics.median(r["cpu_per_step"][role] for r in runs) for role in runs[0]["cpu_per_step"]}
    total = [sum(r["cpu_per_step"].values()) for r in runs]
    out["total"] = statistics.median(total)
    out["per_trajectory_ms"] = out["total"] / per_step_trajectories * 1e3
    return out


def run_part_a(args) -> dict:
    """Every pause mode and eta ``args.repeats`` times, interleaved (repeat r runs every mode and
    eta before r + 1), so that each asynchronous run has a synchronous one of its mode beside it;
    speed-ups are per repeat and per mode."""
    etas = [int(e) for e in args.etas.split(",")]
    modes = args.pause_modes.split(",")
    if etas[0] != 0:
        raise ValueError(f"--etas {args.etas!r} must start with 0 (the synchronous baseline)")
    work = Path(tempfile.mkdtemp(prefix="scale_overlap_"))
    try:
        demo = prepare_demo(work, n_train=args.batch * (args.steps + 1))
        runs = {m: {e: [] for e in etas} for m in modes}
        for rep in range(args.repeats):
            for m in modes:
                for e in etas:
                    if e == 0 and args.eta0_once and m != modes[0]:  # nothing in flight at a synchronous push
                        runs[m][0].append(runs[modes[0]][0][rep])
                        continue
                    r = runs[m][e]
                    r.append(one_run(args, demo, work, e, rep, m))
                    print(f"run {m} eta={e} repeat {rep}: {r[-1]['step_s']:.3f} s/step, wait {r[-1]['gen_s']:.3f} s, "
                          f"train+push {r[-1]['train_s']:.3f} s, rows busy {r[-1]['rows_busy']:.2f}, "
                          f"ready {r[-1]['ready_groups']:.0f}, overdue hold {r[-1]['overdue_wait_s']:.3f} s, load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"part (a): {args.gen_gpus} generation + {args.train_gpus} training GPUs, {args.model}, batch "
          f"{args.batch}x{args.n_samples}, answers lognormal median {args.a_length_median:.0f} capped "
          f"{args.a_max_new_tokens}, time_scale {args.a_time_scale}, {args.repeats} repeat(s): "
          "median [min-max]")
    out: dict = {"paper_speedup": PAPER_SPEEDUP, "time_scale": args.a_time_scale, "repeats": args.repeats,
                 "by_mode": {}}
    for m in modes:
        row = _mode_summary(args, m, etas, runs[m])
        out["by_mode"][m] = row
        if "eta4_of_bound" in row:
            out[f"eta4_of_bound_{m}"] = row["eta4_of_bound"]
            out[f"eta4_of_attainable_{m}"] = row["eta4_of_attainable"]
    default = modes[0] if "in_place" not in modes else "in_place"
    out["eta4_of_bound"] = out["by_mode"][default].get("eta4_of_bound")
    return out


def _mode_summary(args, mode: str, etas: list[int], runs: dict[int, list[dict]]) -> dict:
    """One pause mode's table (printed) and figures."""
    sync = runs[0]
    med = lambda rows, k: statistics.median(r[k] for r in rows)
    gen, train = med(sync, "gen_s"), med(sync, "train_s")
    overlap = (gen + train) / max(gen, train)  # eta=0's generation, tail included, hidden behind training
    busy = busy_generation_s(args, med(sync, "answer_len"), med(sync, "seq_len"))
    bound = med(sync, "step_s") / max(busy, train)  # generation never idle and overlapped with training
    free = {e: attainable_step_s(args, e, sync, mode) for e in etas}  # the same rules, orchestration free
    per_step = args.batch * args.n_samples
    print(f"pause_mode {mode}: eta=0 step: generation wait {gen:.3f} s + train and push {train:.3f} s (real "
          f"seconds); overlap alone {overlap:.2f}x; busy generation of a batch {busy:.3f} s; "
          f"bound max(busy, train) {bound:.2f}x; paper {PAPER_SPEEDUP}x; attainable: the run in virtual time "
          f"with free orchestration (arealite.sim.pipeline), eta=0 {free[0]:.3f} s/step; answers "
          f"{med(sync, 'answer_len'):.0f} tokens on average, {med(sync, 'seq_len'):.0f} with the prompt")
    print(f"{'eta':>4} {'step s':>21} {'push s':>7} {'paused':>7} {'cli CPU':>7} {'speed-up':>21} {'of bound':>8} "
          f"{'attain':>6} {'of att.':>7} {'stale max':>9} {'rows busy':>9} {'ready':>5} {'CPU s/step':>10} {'servers':>7} {'worker':>7} {'trainer':>7} {'ms/traj':>7}")
    out_rows = {}
    for e in etas:
        speedups = [r["steps_per_s"] / s0["steps_per_s"] for r, s0 in zip(runs[e], sync)]
        attainable = free[0] / free[e]
        cpu = _cpu_row(runs[e], per_step)
        row = {"step_s": med(runs[e], "step_s"), "speedup": statistics.median(speedups),
               "speedup_min": min(speedups), "speedup_max": max(speedups),
               "of_bound": statistics.median(speedups) / bound,
               "of_bound_min": min(speedups) / bound, "of_bound_max": max(speedups) / bound,
               "attainable": attainable,
               "of_attainable": statistics.median(speedups) / attainable,
               "of_attainable_min": min(speedups) / attainable,
               "of_attainable_max": max(speedups) / attainable,
               "staleness_max": max(r["staleness_max"] for r in runs[e]), "cpu_per_step_s": cpu["total"],
               "cpu_per_trajectory_ms": cpu["per_trajectory_ms"]}
        out_rows[e] = row
        print(f"{e:>4} {_spread([r['step_s'] for r in runs[e]]):>21} {med(runs[e], 'push_s'):>7.3f} "
              f"{med(runs[e], 'push_paused_s'):>7.3f} {med(runs[e], 'push_client_cpu_s') * 1e3:>7.1f} "
              f"{_spread(speedups):>21} {row['of_bound']:>8.2f} "
              f"{row['attainable']:>6.2f} {row['of_attainable']:>7.2f} {row['staleness_max']:>9} "
              f"{med(runs[e], 'rows_busy'):>9.2f} {med(runs[e], 'ready_groups'):>5.0f} {cpu['total']:>10.3f} "
              f"{cpu['servers']:>7.3f} {cpu['rollout_worker']:>7.3f} {cpu['trainer']:>7.3f} "
              f"{cpu['per_trajectory_ms']:>7.2f}")
    out = {"bound_speedup": round(bound, 3), "overlap_only_speedup": round(overlap, 3),
           "busy_generation_s": round(busy, 4), "train_push_s": round(train, 4),
           "speedup_by_eta": {str(e): round(r["speedup"], 3) for e, r in out_rows.items()},
           "speedup_spread_by_eta": {str(e): [round(r["speedup_min"], 3), round(r["speedup_max"], 3)]
                                     for e, r in out_rows.items()},
           "of_bound_by_eta": {str(e): round(r["of_bound"], 3) for e, r in out_rows.items()},
           "attainable_step_s_by_eta": {str(e): round(t, 4) for e, t in free.items()},
           "attainable_speedup_by_eta": {str(e): round(r["attainable"], 3) for e, r in out_rows.items()},
           "attainable_of_bound_by_eta": {str(e): round(r["attainable"] / bound, 3) for e, r in out_rows.items()},
           "of_attainable_by_eta": {str(e): round(r["of_attainable"], 3) for e, r in out_rows.items()},
           "push_paused_s_by_eta": {str(e): round(med(runs[e], "push_paused_s"), 4) for e in etas},
           "push_client_cpu_ms_by_eta": {str(e): round(med(runs[e], "push_client_cpu_s") * 1e3, 2) for e in etas},
           "staleness_max_by_eta": {str(e): r["staleness_max"] for e, r in out_rows.items()},
           "rows_busy_by_eta": {str(e): round(med(runs[e], "rows_busy"), 3) for e in etas},
           "ready_groups_at_push_by_eta": {str(e): med(runs[e], "ready_groups") for e in etas},
           "overdue_wait_s_per_step_by_eta": {str(e): round(med(runs[e], "overdue_wait_s"), 4) for e in etas},
           "orchestration_cpu_s_per_step": {str(e): round(r["cpu_per_step_s"], 3) for e, r in out_rows.items()},
           "orchestration_cpu_ms_per_trajectory": {str(e): round(r["cpu_per_trajectory_ms"], 2)
                                                   for e, r in out_rows.items()}}
    if 4 in out_rows:
        out["eta4_of_bound"] = round(out_rows[4]["of_bound"], 3)
        out["eta4_of_bound_spread"] = [round(out_rows[4]["of_bound_min"], 3), round(out_rows[4]["of_bound_max"], 3)]
        out["eta4_of_attainable"] = round(out_rows[4]["of_attainable"], 3)
        out["eta4_of_attainable_spread"] = [round(out_rows[4]["of_attainable_min"], 3),
                                            round(out_rows[4]["of_attainable_max"], 3)]
        out["eta4_attainable_of_bound"] = round(out_rows[4]["attainable"] / bound, 3)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("part (a): AReaL's setup simulated (scale_overlap.py)")
    g.add_argument("--etas", default="0,1,2,4,8")
    g.add_argument("--gen-gpus", type=int, default=3, help="simulated generation servers (1 GPU each)")
    g.add_argument("--train-gpus", type=int, default=1)
    g.add_argument("--model", default="1.5b", choices=["1.5b", "7b", "14b", "32b"])
    g.add_argument("--mfu", type=float, default=0.4)
    g.add_argument("--batch", type=int, default=16, help="prompts per step")
    g.add_argument("--n-samples", type=int, default=4, help="answers per prompt")
    g.add_argument("--a-max-new-tokens", dest="a_max_new_tokens", type=int, default=2048)
    g.add_argument("--a-length-median", dest="a_length_median", type=float, default=1024)
    g.add_argument("--a-max-concurrent", dest="a_max_concurrent", type=int, default=64,
                   help="rollout.max_concurrent_rollouts (groups in flight; 64, the default, binds at eta >= 4 "
                        "together with the staleness budget: docs/scale.md)")
    g.add_argument("--steps", type=int, default=24)
    g.add_argument("--skip", type=int, default=10,
                   help="steps left out of the throughput (warm-up): the groups admitted before the first "
                        "push come in over that long first step, all of version 0, and hold batches for "
                        "up to eta steps; 10 leaves them out at eta 8")
    g.add_argument("--a-time-scale", dest="a_time_scale", type=float, default=0.5,
                   help="simulated compute takes this many real seconds per simulated second; 0.5 keeps "
                        "the orchestration's CPU (~0.4 s a step) a fraction of a step on two cores")
    g.add_argument("--repeats", type=int, default=3, help="runs per eta, interleaved; medians and spread")
    g.add_argument("--eta0-once", dest="eta0_once", action="store_true",
                   help="run eta = 0 once per repeat (with the first mode) and use it for every mode: a "
                        "synchronous push has nothing in flight, so the pause mode cannot change it")
    g.add_argument("--pause-modes", default="abort,retract,in_place",
                   help="weight_sync.pause_mode values to run, each with every eta")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(p)
    p.add_argument("--quick", action="store_true",
                   help="eta 0 and 4, 6 steps: a smoke run, its steps 3-6 inside the start-up transient")
    args = p.parse_args()
    if args.quick:
        args.etas, args.steps, args.skip, args.repeats = "0,4", 6, 2, 1
        print("--quick: steps 3-6 are inside the start-up transient (groups of version 0 still arriving); "
              "the steady-state figures need the default --steps 24 --skip 10", flush=True)
    print(json.dumps(run_part_a(args)))


if __name__ == "__main__":
    main()
