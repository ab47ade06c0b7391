"""Config sections: one pydantic model per component, ``extra="forbid"``.

Every field carries a docstring (it becomes the description in the JSON
schema and in docs/config_reference.md) and a recommended default.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from arealite.config.agent import AgentConfig
from arealite.config.environments import ReasoningGymConfig
from arealite.config.section import Section


# Experiment and trial names become directory names under `output_root`.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _check_dir_name(value: str) -> str:
    if not _NAME_RE.match(value):
        raise ValueError(
            "must be a non-empty directory name of letters, digits, '.', '_' or '-' "
            "(no '/' or spaces), starting with a letter or digit"
        )
    return value


def _check_server_addr(addr: str) -> str:
    """`host:port` with a port in 1..65535 (IPv6 hosts in brackets: `[::1]:30000`)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{addr!r} is not `host:port` with a port in 1..65535 (e.g. 127.0.0.1:30000)")
    return addr


class ExperimentConfig(Section):
    name: str = "arealite"
    """Experiment name; runs are written under `<output_root>/<name>/<trial>`."""
    trial: str = "trial0"
    """Trial name within the experiment; re-running the same name resumes it."""
    output_root: str = "runs"
    """Root directory of all run outputs (logs, checkpoints, stats, plots)."""
    seed: int = 1
    """Global random seed (torch, python, numpy, data shuffling, server sampling)."""

    @field_validator("name", "trial")
    @classmethod
    def _dir_name(cls, v: str) -> str:
        return _check_dir_name(v)


_RESOURCE_NAME_RE = re.compile(r"^[A-Za-z0-9_.:/-]+$")


def _check_resources(v: dict[str, float]) -> dict[str, float]:
    for name, amount in v.items():
        if name in ("CPU", "GPU", "memory") or not _RESOURCE_NAME_RE.match(name):
            raise ValueError(f"{name!r} is not a custom resource name (CPUs and GPUs have their own fields)")
        if amount <= 0:
            raise ValueError(f"{name}: {amount} must be > 0")
    return v


class RayLaunchConfig(Section):
    """Placement of a run on an existing Ray cluster (`python -m arealite.launcher.ray`)."""

    address: str = Field("auto", min_length=1)
    """Ray cluster to join: `auto` (the RAY_ADDRESS variable, else the cluster `ray start` started on
    this machine) or the `host:port` of its head node."""
    connect_timeout_s: float = Field(10.0, gt=0)
    """How long to try reaching the cluster's head node before giving up."""
    server_cpus: float = Field(1.0, gt=0)
    """CPUs reserved for each inference server."""
    server_gpus: float | None = Field(None, ge=0)
    """GPUs reserved for each inference server (None: `server.sglang.tp_size` with SGLang, 0 with the
    embedded server)."""
    trainer_cpus: float = Field(1.0, gt=0)
    """CPUs reserved for each trainer rank (`launch.n_trainer_procs` ranks in all)."""
    trainer_gpus: float = Field(0.0, ge=0)
    """GPUs reserved for each trainer rank (1 on a GPU cluster)."""
    server_resources: dict[str, float] = Field(default_factory=dict)
    """Custom node resources each server needs, e.g. `{inference_node: 1}` to keep servers on the nodes
    started with `ray start --resources '{"inference_node": 8}'`."""
    trainer_resources: dict[str, float] = Field(default_factory=dict)
    """Custom node resources each trainer rank needs."""
    separate_nodes: bool = False
    """Never place a trainer rank on a node that runs a server (inference and training on distinct nodes)."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement-group strategy within each role (servers; trainer ranks). PACK keeps the trainer
    ranks on as few nodes as possible."""
    placement_timeout_s: float = Field(120.0, gt=0)
    """How long to wait for the cluster to grant the placement groups."""

    @field_validator("server_resources", "trainer_resources")
    @classmethod
    def _resources(cls, v: dict[str, float]) -> dict[str, float]:
        return _check_resources(v)


class SlurmLaunchConfig(Section):
    """The batch job `python -m arealite.launcher.slurm` writes and submits."""

    trainer_nodes: int = Field(1, ge=1)
    """Nodes of the trainer (`torchrun --nnodes`); `launch.n_trainer_procs` must divide evenly among them."""
    server_nodes: int = Field(0, ge=0)
    """Nodes for the inference servers alone (0: the servers run on the trainer nodes)."""
    partition: str | None = None
    """`sbatch --partition` (None: the cluster's default)."""
    account: str | None = None
    """`sbatch --account` (None: the user's default)."""
    time_limit: str | None = None
    """`sbatch --time`, e.g. `24:00:00` (None: the partition's default)."""
    gpus_per_node: int = Field(0, ge=0)
    """`sbatch --gpus-per-node` (0: no GPU request, for CPU runs)."""
    cpus_per_node: int | None = Field(None, ge=1)
    """CPUs per node requested (`--cpus-per-task` of the job's single task per node; None: the default)."""
    rendezvous_port: int = Field(29500, ge=1, le=65535)
    """Port of the trainers' torchrun rendezvous on the first trainer node."""
    sbatch_args: list[str] = Field(default_factory=list)
    """Extra `#SBATCH` lines, verbatim (e.g. `--exclusive`, `--mem=0`)."""


class LaunchConfig(Section):
    n_servers: int = Field(1, ge=0)
    """Number of inference servers the local launcher starts (0 = use `server_addrs`)."""
    server_backend: Literal["embedded", "sglang", "sim"] = "embedded"
    """`embedded` (arealite's CPU/GPU server in PyTorch), `sglang` (GPU inference engine) or `sim`
    (the embedded server's protocol with a GPU cost model instead of the model, `server.sim`;
    docs/scale.md)."""
    server_addrs: list[str] = Field(default_factory=list)
    """Addresses `host:port` of servers started outside the launcher. Also read from
    the environment variable AREALITE_SERVER_ADDRS (comma-separated)."""
    n_trainer_procs: int = Field(1, ge=1)
    """Number of trainer processes `torchrun` starts (one per GPU on CUDA)."""
    server_startup_timeout_s: float = Field(300.0, gt=0)
    """How long to wait for every server's `/health` before giving up."""
    server_cpus: int | None = Field(None, ge=1)
    """Pin processes to CPU cores (Linux): this many of the launcher's cores go to the
    servers it starts (split evenly between them), the others to the trainer processes.
    Keeps inference and training from taking each other's cores when they run at the
    same time (asynchronous RL on a CPU machine). `null`: no pinning."""
    trainer_env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables for the trainer processes."""
    on_server_death: Literal["continue", "stop"] = "continue"
    """What the launcher does when one of its servers dies mid-run: `continue` logs it and
    goes on with the others (the trainer drops it from rotation and weight updates; the
    last one dying still stops the run, exit 3); `stop` ends the run at once (exit 3)."""
    cluster_bind: Literal["node_ip", "all_interfaces"] = "node_ip"
    """Ray and Slurm launchers: where servers bind. `node_ip`: each node's own IP (what Ray reports, or the
    host's outgoing interface under Slurm); `all_interfaces`: 0.0.0.0. Either way every address handed
    to another process (servers, the trainers' rendezvous, the weight-update group's store) is the node's
    IP. The local launcher binds `server.host` (127.0.0.1) instead."""
    ray: RayLaunchConfig = Field(default_factory=RayLaunchConfig)
    """Placement on a Ray cluster (`python -m arealite.launcher.ray`)."""
    slurm: SlurmLaunchConfig = Field(default_factory=SlurmLaunchConfig)
    """The Slurm batch job (`python -m arealite.launcher.slurm`)."""

    @field_validator("server_addrs")
    @classmethod
    def _addrs(cls, v: list[str]) -> list[str]:
        for addr in v:
            _check_server_addr(addr)
        return v

    @field_validator("trainer_env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
                raise ValueError(
                    f"{name!r} is not a valid environment variable name "
                    "(letters, digits and '_', not starting with a digit)"
                )
        return v


class SGLangOptions(Section):
    mem_fraction_static: float = Field(0.8, gt=0, le=1)
    """Fraction of GPU memory SGLang reserves for weights and KV cache."""
    tp_size: int = Field(1, ge=1)
    """Tensor-parallel size of each SGLang server."""
    skip_tokenizer_init: bool = True
    """Run SGLang without a tokenizer (token-in/token-out)."""
    context_length: int | None = None
    """Override the model's context length (None = the model's own)."""
    extra_args: list[str] = Field(default_factory=list)
    """Extra command-line arguments passed verbatim to `sglang.launch_server`."""

    @field_validator("extra_args")
    @classmethod
    def _no_data_parallel(cls, v: list[str]) -> list[str]:
        # One server is one weight-update group member and one rotation entry: SGLang refuses
        # distributed weight updates with dp_size > 1 (tokenizer manager asserts it).
        for i, arg in enumerate(v):
            name, _, inline = arg.partition("=")
            if name in ("--dp-size", "--dp", "--data-parallel-size"):
                value = inline or (v[i + 1] if i + 1 < len(v) else "")
                if value.strip() != "1":
                    raise ValueError(
                        f"{arg} {'' if inline else value}: SGLang's data parallelism cannot take "
                        "distributed weight updates; run more servers instead (launch.n_servers)")
        return v


class SimOptions(Section):
    """A simulated server's cost model (`launch.server_backend: sim`; docs/scale.md)."""

    gpu: Literal["a100", "h100", "h200"] = "h100"
    """The GPU simulated (its bf16 peak, HBM bandwidth and memory)."""
    model: Literal["1.5b", "7b", "14b", "32b"] = "7b"
    """The model size simulated (Qwen2.5 shapes: parameters and KV bytes per token)."""
    gpus_per_server: int = Field(1, ge=1)
    """Tensor-parallel GPUs of one simulated server."""
    mem_fraction: float = Field(0.85, gt=0, le=1)
    """Share of GPU memory for weights and KV cache."""
    mbu: float = Field(0.7, gt=0, le=1)
    """Achieved share of HBM bandwidth in decode."""
    mfu_decode: float = Field(0.3, gt=0, le=1)
    """Achieved share of peak FLOPs in decode."""
    mfu_prefill: float = Field(0.5, gt=0, le=1)
    """Achieved share of peak FLOPs in prefill."""
    step_overhead_ms: float = Field(2.0, ge=0)
    """Scheduler and launch time of every batch step."""
    length_median: float = Field(512.0, gt=0)
    """Median response length in tokens (lognormal, capped at `max_new_tokens`)."""
    length_sigma: float = Field(1.0, ge=0)
    """Spread of the lognormal lengths (standard deviation of their log)."""
    lengths_file: str | None = None
    """Draw response lengths from this file (one integer per line) instead of the lognormal."""
    weight_gbps: float = Field(25.0, gt=0)
    """Bandwidth of one server's weight update in GB/s (the update holds generation bytes / this long)."""
    time_scale: float = Field(1.0, gt=0)
    """Simulated seconds take this many real seconds (0.01 runs the GPU 100x fast; orchestration
    always runs in real time)."""


class ServerConfig(Section):
    model_path: str | None = None
    """Model directory the servers load at start (None = `actor.model_path`)."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "auto"
    """Server weight dtype; `auto` = float32 on CPU, bfloat16 on CUDA."""
    host: str = Field("127.0.0.1", min_length=1)
    """Interface the servers of the local launcher bind to. Keep 127.0.0.1 unless other hosts must
    reach them (the Ray and Slurm launchers bind per `launch.cluster_bind`)."""
    base_port: int = Field(0, ge=0, le=65535)
    """First port to try (0 = pick free ports)."""
    api_key: str | None = Field(None, min_length=1)
    """If set, every request except the `/health*` probes must carry `Authorization: Bearer <api_key>`; never logged."""
    random_seed: int | None = None
    """Server sampling seed (None = `experiment.seed`)."""
    max_batch_size: int = Field(64, ge=1)
    """Embedded server: most sequences decoded together in one batch."""
    prompt_cache_entries: int = Field(64, ge=0)
    """Embedded server: prompts whose KV cache is kept, so that a group's samples admitted after
    the first ones (the batch had too few free rows) skip the prompt's forward; cleared on every
    weight update; at most 256 MiB of keys and values. 0 turns it off."""
    context_length: int | None = Field(None, ge=1)
    """Embedded server: longest prompt + completion accepted (None = the model's max positions)."""
    sglang: SGLangOptions = Field(default_factory=SGLangOptions)
    """Options used only when `launch.server_backend` is `sglang`."""
    sim: SimOptions = Field(default_factory=SimOptions)
    """Options used only when `launch.server_backend` is `sim`."""
    strict_sglang: bool = False
    """Embedded server: behave as SGLang where it is unforgiving (`/health` generates and waits while
    paused; weights read back only for SGLang's model classes). Tests run with it on."""
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    """Embedded server: largest request body in bytes; a bigger `Content-Length` is refused (413)
    before the body is read (see docs/security.md)."""
    max_prompts_per_request: int = Field(1024, ge=1)
    """Embedded server: most prompts in one `/generate` batch."""
    max_request_tokens: int = Field(1 << 20, ge=1)
    """Embedded server: most tokens one `/generate` request asks for (prompts plus
    `max_new_tokens`, summed over its batch)."""
    idle_timeout_s: float = Field(60.0, gt=0)
    """Embedded server: a connection that sends no complete request head this long after
    connecting (or after its last answer) is closed (idle keep-alive, slow-header clients)."""
    body_timeout_s: float = Field(60.0, gt=0)
    """Embedded server: longest wait for a request body once its head arrived (408 after)."""
    allowed_origins: list[str] = Field(default_factory=list)
    """Embedded server: browser origins (`http://host:port`) allowed to call the servers. Every
    other request with an `Origin` header is refused (403), so that a web page open in a browser
    on this host cannot drive them (cross-site request forgery). Empty (the default) suits
    every non-browser client."""

    @field_validator("allowed_origins")
    @classmethod
    def _origins(cls, v: list[str]) -> list[str]:
        for o in v:
            if "://" not in o or "," in o or not o.strip() or o != o.strip():
                raise ValueError(f"server.allowed_origins: {o!r} is not an origin such as "
                                 "'http://localhost:8080' (scheme://host[:port], no comma)")
        return v


class RolloutConfig(Section):
    workflow: str = Field("rlvr", min_length=1)
    """The `RolloutWorkflow` that turns one dataset item into trajectories: a built-in name
    (`rlvr`, `multi_turn`; see `arealite.workflow.registry`) or `module:Class` of your own.
    Its constructor gets, by parameter name, any of `config`, `tokenizer`, `generation`,
    `rollout`, `data`, `reward_fn`, plus `workflow_kwargs` (or a `from_config` classmethod)."""
    workflow_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the workflow's constructor, checked against its signature
    before anything starts."""
    worker: Literal["process", "thread"] = "process"
    """Where each trainer rank's rollout runs (client, controller, workflows, rewards):
    `process`, a child process with its own GIL, so that handling responses never slows
    the training step that runs meanwhile (on the servers' cores when `launch.server_cpus`
    pins them); `thread`, a thread of the trainer process (a workflow object passed to
    `RLTrainer` that cannot be pickled needs it)."""
    max_concurrent_rollouts: int = Field(64, ge=1)
    """Most episodes (workflow calls) in flight at once, per trainer rank."""
    queue_size: int = Field(1024, ge=1)
    """Capacity of the input and output queues; a full queue back-pressures admission."""
    consumer_batch_size: int = Field(8, ge=1)
    """Trajectory groups (prompts) per training step, over all trainer ranks."""
    max_head_offpolicyness: int = Field(2, ge=0)
    """Staleness bound eta in policy versions; 0 = synchronous RL."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Timeout of one HTTP generation request before it is retried elsewhere."""
    request_retries: int = Field(3, ge=0)
    """Retries of a failed request (on another healthy server) before the error is raised."""
    retry_backoff_s: float = Field(0.5, ge=0)
    """First backoff between retries; doubles on each retry."""
    max_inflight_per_server: int = Field(256, ge=1)
    """Most requests in flight on one server; fewer where the server reports
    ``max_running_requests`` in its ``/server_info`` (twice that: a batch running, one
    waiting), since a weight update aborts every request queued there."""
    batch_requests: bool = True
    """Send the requests of one affinity key that leave together (a group's samples) to their
    server as one batched `/generate` (SGLang's batch form): one HTTP exchange instead of
    one each. Each request keeps its own retries and resubmission after an abort."""
    max_response_bytes: int = Field(64 << 20, ge=4096)
    """Largest answer (body bytes) the client reads from a server; a bigger one is refused as
    malformed (from its Content-Length, or as it arrives) and the request retried elsewhere."""
    on_workflow_error: Literal["fail", "drop"] = "fail"
    """What a raising workflow does to the run: `fail` stops it, `drop` logs, counts and goes on."""
    reward_timeout_s: float = Field(15.0, gt=0)
    """Timeout of one reward-function call."""
    on_reward_error: Literal["zero", "reject"] = "zero"
    """A reward function that raises, hangs or returns a non-number: reward 0 or reject the group."""
    reward_workers: int = Field(2, ge=1)
    """Threads running reward functions off the event loop."""
    dump_dir: str | None = None
    """If set, dump generated texts per policy version as JSONL here, for inspection."""
    filter_equal_rewards: bool = False
    """Dynamic sampling: reject groups whose rewards are all equal (no GRPO signal)."""
    gil_switch_interval_ms: float | None = Field(0.5, gt=0)
    """`sys.setswitchinterval` of the process while the controller runs. The rollout loop
    thread and the training thread share the GIL: a thread that wants it back (the trainer
    between two torch ops) waits until the other blocks or this interval ends. Python's
    default, 5 ms, lets bursts of response handling stall training; `null` keeps it."""
    freeze_gc: bool = True
    """At start, move every object alive so far (model, modules, imports) out of the cyclic
    garbage collector's reach (`gc.freeze()`), in the rollout side's process and in every
    trainer rank, so the collections that the rollout's churn and the training steps
    trigger scan only young objects instead of stopping the process for the whole heap
    (~0.2 s each on a CPU host). Cycles among those older objects are then never
    collected; turn off to keep them. (Servers: ``--no-freeze-gc``.)"""


class GenerationConfig(Section):
    n_samples: int = Field(4, ge=1)
    """Samples per prompt (the GRPO group size)."""
    max_new_tokens: int = Field(256, gt=0)
    """Most tokens generated per sample."""
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature; 0 is greedy."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling threshold."""
    top_k: int = Field(-1, ge=-1)
    """Top-k sampling (-1 = all tokens)."""
    min_p: float = Field(0.0, ge=0, le=1)
    """Min-p sampling threshold (0 = off)."""
    stop_token_ids: list[int] = Field(default_factory=list)
    """Extra token ids that end a sample (the EOS token always does)."""
    greedy: bool = False
    """Decode greedily (argmax), whatever the temperature."""


class OptimizerConfig(Section):
    type: Literal["adamw"] = "adamw"
    """Optimizer."""
    lr: float = Field(1e-6, gt=0)
    """Peak learning rate."""
    weight_decay: float = Field(0.01, ge=0)
    """Decoupled weight decay."""
    beta1: float = Field(0.9, ge=0, lt=1)
    """Adam beta1."""
    beta2: float = Field(0.999, ge=0, lt=1)
    """Adam beta2."""
    eps: float = Field(1e-8, gt=0)
    """Adam epsilon."""
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    """LR schedule after warmup."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup steps from 0 to `lr`."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Final LR of the linear/cosine schedule, as a fraction of `lr`."""
    total_steps: int | None = Field(None, ge=1)
    """Steps of the schedule (None = set by the training script from the data)."""
    gradient_clipping: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this (0 = no clipping)."""


class SimTrainOptions(Section):
    """A simulated train engine's cluster (`actor.backend: sim`; docs/scale.md)."""

    gpu: Literal["a100", "h100", "h800", "h200"] = "h800"
    """The training GPUs (their dense bf16 peak)."""
    model: Literal["1.5b", "7b", "14b", "32b"] = "7b"
    """The model size trained (parameters)."""
    n_gpus: int = Field(8, ge=1)
    """Training GPUs; a step's FLOPs are spread over all of them."""
    mfu: float = Field(0.4, gt=0, le=1)
    """Achieved share of peak FLOPs in training."""


class LoraConfig(Section):
    rank: int = Field(16, ge=1)
    """LoRA rank r: each adapted weight W [out, in] gets B [out, r] @ A [r, in]."""
    alpha: float = Field(32.0, gt=0)
    """LoRA alpha: the update is scaled by `alpha / rank`."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input in training (PEFT's `lora_dropout`). Keep 0 with decoupled
    PPO: the proximal log-probs come from the training forward, which must score as `forward`."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1)
    """Names of the linear modules to adapt (the last part of the module path, e.g. `q_proj`);
    every name must match a linear layer of the model (the engine lists them otherwise)."""
    served_name: str = Field("policy", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """The name the inference servers serve the adapter under: every request's `lora_path`.
    Each push unloads it and loads the new adapter under the same name while generation is
    paused, so every trainer rank's client knows it from the config alone."""

    @field_validator("target_modules")
    @classmethod
    def _distinct_names(cls, v: list[str]) -> list[str]:
        for name in v:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
                raise ValueError(f"{name!r} is not a module name (letters, digits and '_', e.g. 'q_proj')")
        if len(set(v)) != len(v):
            raise ValueError(f"{v} names a module twice")
        return v


class ActorConfig(Section):
    model_path: str = ""
    """Hugging Face model directory to train (config.json, safetensors, tokenizer)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype of the parameters; `auto` = bfloat16 on CUDA, float32 on CPU. Master
    weights, optimizer state and the gradient reduction over ranks stay float32."""
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    """Optimizer and LR schedule."""
    mb_max_tokens: int = Field(8192, ge=1)
    """Token budget of one packed micro-batch."""
    attn_impl: Literal["auto", "varlen", "flex", "sdpa_loop"] = "auto"
    """Attention over the sequences of a packed micro-batch: `varlen` (torch's FlashAttention
    varlen kernel, one kernel per layer; CUDA with bfloat16/float16 compute only), `flex` (flex
    attention with a document-causal block mask: compiled on CUDA, torch's unfused reference
    kernel on CPU), `sdpa_loop` (one SDPA call per run of equal-length sequences; runs anywhere),
    `auto` = `varlen` where it can run, else `sdpa_loop` (faster than `flex` on CPU). A choice
    that cannot run on the engine's device is refused at start (see docs/training.md)."""
    sp_size: int = Field(1, ge=1)
    """Ulysses sequence parallelism: each packed micro-batch is split by tokens over this many
    ranks, with an all-to-all over attention heads around attention (the ranks form a data x
    sequence mesh; the world size must be a multiple). Lets one long answer's activations spread
    over several devices. Needs the attention heads divisible by it (KV heads are repeated when
    fewer). See docs/training.md."""
    tp_size: int = Field(1, ge=1)
    """Tensor parallelism: the attention and MLP projections of each decoder layer are split over
    this many ranks (a data x tensor mesh, composed with FSDP2 over the data ranks), for
    Llama/Qwen2/Qwen3/Mistral-style models; heads, KV heads and the MLP width must divide by it.
    Not with `sp_size` > 1 or LoRA. See docs/training.md."""
    ep_size: int = Field(1, ge=1)
    """Expert parallelism for a mixture-of-experts model: each MoE layer's experts are split over
    this many ranks (an expert x data mesh), tokens go to their experts' ranks and back by
    all-to-all; FSDP2 shards the rest. The experts per layer and the world size must divide by
    it. Not with `sp_size`, `tp_size` > 1 or LoRA. See docs/moe.md."""
    router_aux_loss_coef: float = Field(0.0, ge=0)
    """Weight of a mixture-of-experts router's load-balancing loss (Switch-style, 1 when balanced,
    mean over MoE layers) added to the training loss; 0 = off, as the peers run RL. See docs/moe.md."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    cpu_offload: bool = False
    """Offload parameters and gradients to CPU (FSDP2 CPUOffloadPolicy)."""
    freeze_vision: bool = False
    """A vision-language model: train its language model only; the vision tower keeps its
    weights (no gradient, no optimizer state). See docs/vision.md."""
    temperature: float | None = Field(None, gt=0)
    """Temperature used to recompute log-probs (None = `generation.temperature`)."""
    lora: LoraConfig | None = None
    """LoRA adapters (PEFT) instead of full fine-tuning: only the adapters train, have optimizer
    state and are pushed to the servers (see docs/lora.md); null = full fine-tuning."""
    backend: Literal["fsdp", "sim"] = "fsdp"
    """`fsdp` trains the model; `sim` simulates a GPU cluster's training time (`actor.sim`,
    docs/scale.md) and pushes `model_path`'s small tensors in place of the simulated model's."""
    sim: SimTrainOptions = Field(default_factory=SimTrainOptions)
    """Options used only when `backend` is `sim`."""


class MismatchConfig(Section):
    mode: Literal["none", "tis", "mis"] = "none"
    """Rollout-train mismatch correction between the server's and the trainer's log-probs of
    the sampled tokens (needs `use_decoupled_loss`): `tis` truncates the importance weight
    into [`lower`, `upper`], `mis` leaves tokens (or sequences) outside it out of the loss,
    `none` only logs the mismatch (see `arealite.algo.mismatch`)."""
    level: Literal["token", "sequence"] = "token"
    """`token`: each token's weight; `sequence`: the geometric mean of a sequence's weights,
    on all its tokens."""
    upper: float = Field(2.0, gt=1)
    """Upper bound of the importance weight (> 1)."""
    lower: float | None = Field(None, ge=0, lt=1)
    """Lower bound (in [0, 1)); null = one-sided (only `upper`)."""


class OverlongConfig(Section):
    buffer_len: int | None = Field(None, ge=1)
    """DAPO soft overlong punishment: over the last `buffer_len` tokens before
    `generation.max_new_tokens` the reward gets a penalty ramping from 0 to
    -`penalty_factor` (null = off; see `arealite.algo.overlong`)."""
    penalty_factor: float = Field(1.0, ge=0)
    """Size of the full overlong penalty."""
    exclude_truncated: bool = False
    """DAPO overlong filtering: leave samples cut at the length limit out of the loss."""


class AlgorithmConfig(Section):
    adv_estimator: str = Field("grpo", min_length=1)
    """Advantage estimator: a built-in, `grpo` (group mean/std), `drgrpo` (group mean), `rloo`
    (leave-one-out), `reinforce_pp` / `reinforce_pp_baseline` (REINFORCE++, with `adv_norm:
    batch`), `gae` (PPO with a critic: needs `critic.enabled`), `none` (raw reward), or
    `module:function` of your own, called as `fn(rewards [B], group_id [B]) -> advantages [B]`
    (see `arealite.algo.advantage`)."""
    policy_loss: str = Field("ppo", min_length=1)
    """Policy loss: a built-in, `ppo` (clipped surrogate with `eps_clip`, `c_clip` and the
    decoupled behaviour weight), `gspo` / `gspo_token` (sequence-level ratio and clipping;
    use small clip ranges, e.g. `eps_clip: 3.0e-4`, `eps_clip_high: 4.0e-4`), or
    `module:function` of your own, called per micro-batch as
    `fn(logp, prox_logp, advantages, loss_mask, behav_logp, config) -> (token_loss, stats)`
    (see `arealite.algo.loss`). KL and entropy terms and `loss_agg_mode` apply around it."""
    adv_norm: Literal["none", "batch"] = "none"
    """Extra normalisation of advantages over the whole batch."""
    reward_scale: float = 1.0
    """Rewards are mapped to `clip((r + bias) * scale)`."""
    reward_bias: float = 0.0
    """Added to rewards before scaling."""
    reward_clip: float | None = Field(None, gt=0)
    """Clip scaled rewards to [-reward_clip, reward_clip] (None = no clipping)."""
    eps_clip: float = Field(0.2, gt=0)
    """PPO clip epsilon (lower side, and upper side unless `eps_clip_high` is set)."""
    eps_clip_high: float | None = Field(None, gt=0)
    """Upper clip epsilon (clip-higher, DAPO); None = `eps_clip`."""
    c_clip: float | None = Field(None, gt=1)
    """Dual-clip constant (> 1) bounding the loss of negative-advantage tokens; None = off."""
    use_decoupled_loss: bool = True
    """Decoupled PPO: proximal log-probs are recomputed before the update; behaviour
    log-probs from the server weight the loss (importance weight capped)."""
    behav_imp_weight_cap: float | None = Field(5.0, gt=1)
    """Tokens whose behaviour importance weight exceeds this are masked out (None = no cap)."""
    routing_replay: Literal["none", "r3"] = "none"
    """Mixture-of-experts models: `r3` asks the servers for the experts they routed each token
    to (`return_routed_experts`; servers need `--enable-return-routed-experts`) and the trainer's
    forwards use them instead of its own top-k (docs/moe.md); `none`: the trainer's router chooses."""
    kl_coef: float = Field(0.0, ge=0)
    """Coefficient of the KL penalty to the reference model (0 = no reference model)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman's k1, k2, k3)."""
    kl_in_reward: bool = False
    """Put the KL penalty in the per-token reward (`-kl_coef * KL_t`, REINFORCE++ and classic
    RLHF PPO) instead of in the loss; needs `kl_coef > 0`."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount of token rewards in GAE and in the reward-to-go of the other estimators
    (< 1: earlier tokens get less of the final reward; 1: every token gets the advantage)."""
    gae_lambda: float = Field(1.0, ge=0, le=1)
    """GAE lambda (`adv_estimator: gae`): 1 = Monte-Carlo return minus the value, 0 = one-step TD."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus coefficient."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How token losses become one scalar."""
    loss_agg_constant: float | None = Field(None, gt=0)
    """Length normaliser of `seq-mean-token-sum` (None = `generation.max_new_tokens`)."""
    n_minibatches: int = Field(1, ge=1)
    """Optimizer steps per training batch (the batch is split into this many mini-batches)."""
    stepwise_divide_by_steps: bool = False
    """Multi-step trajectories: divide the broadcast advantage by the number of steps."""
    mismatch: MismatchConfig = Field(default_factory=MismatchConfig)
    """Rollout-train mismatch correction (TIS / MIS)."""
    overlong: OverlongConfig = Field(default_factory=OverlongConfig)
    """DAPO's overlong reward shaping and filtering."""


#: The reward of `data.source: reasoning_gym` when `data.reward_fn` is not set: the task's own score.
REASONING_GYM_REWARD = "arealite.environments.reasoning_gym:reasoning_gym_reward"


class DataConfig(Section):
    source: Literal["files", "reasoning_gym", "environment"] = "files"
    """Where the prompts come from: `files` (`train_path`, `eval_path`), `reasoning_gym`
    (generated by reasoning-gym's tasks, `reasoning_gym`; `pip install 'arealite[envs]'`) or
    `environment` (the datasets of the workflow's environment: `rollout.workflow: verifiers`
    or `openenv`)."""
    reasoning_gym: ReasoningGymConfig | None = None
    """The reasoning-gym task(s) of `source: reasoning_gym`: `{task, config, size, eval_size,
    seed, answer_format, prompt_template}` or a weighted composite `tasks: [{name, weight, config}]`."""
    train_path: str = ""
    """Training prompts: a JSONL file (one object per line), a Parquet file, or a directory
    saved by `datasets.Dataset.save_to_disk` (Parquet and directories need `arealite[data]`)."""
    eval_path: str | None = None
    """Held-out prompts for evaluation, in any of the formats of `train_path`."""
    shuffle: bool = True
    """Shuffle prompts every epoch (seeded by `experiment.seed` and the epoch)."""
    prompt_key: str = Field("prompt", min_length=1)
    """Field holding the prompt text (or `messages`, a chat list)."""
    answer_key: str = Field("answer", min_length=1)
    """Field holding the reference answer passed to the reward function."""
    apply_chat_template: bool = False
    """Wrap prompts with the tokenizer's chat template."""
    reward_fn: str = Field("arealite.reward.math:math_reward", pattern=r"^[\w.]+:[\w.]+$")
    """Reward function as `module:function`, called as
    `fn(prompt, completion, prompt_ids, completion_ids, **row_fields) -> float`. Unset with
    `source: reasoning_gym`, the task's own `score_answer` (`REASONING_GYM_REWARD`)."""
    max_prompt_len: int | None = Field(None, ge=1)
    """Prompts longer than this (in tokens) are an error before training starts."""
    image_key: str = Field("images", min_length=1)
    """Field holding a row's images (vision-language models, docs/vision.md): a list (or one) of
    file paths relative to the data file, base64 strings, data URLs, bytes or `{bytes, path}`
    (datasets' `Image` feature), in the order of the prompt's `<image>` placeholders."""
    max_image_pixels: int = Field(12_845_056, ge=1)
    """Images of more pixels (width x height) are an error before training starts."""
    total_train_epochs: int = Field(1, ge=1)
    """Epochs over the training prompts."""
    max_train_steps: int | None = Field(None, ge=1)
    """Stop after this many training steps (None = run all epochs)."""

    @model_validator(mode="before")
    @classmethod
    def _task_score_by_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("source") == "reasoning_gym" and "reward_fn" not in data:
            data = {**data, "reward_fn": REASONING_GYM_REWARD}
        return data

    @model_validator(mode="after")
    def _source_has_its_settings(self) -> "DataConfig":
        if self.source == "reasoning_gym":
            if self.reasoning_gym is None:
                raise ValueError("source is reasoning_gym but reasoning_gym is not set: add "
                                 "`reasoning_gym: {task: <name>, size: N}` (or `tasks: [...]`)")
        if self.source != "files" and (self.train_path or self.eval_path):
            raise ValueError(f"source is {self.source}, which supplies the prompts: remove "
                             "train_path and eval_path (or set source: files)")
        if self.source != "reasoning_gym" and self.reasoning_gym is not None:
            raise ValueError(f"reasoning_gym is set but source is {self.source}: set source: reasoning_gym "
                             "(or remove the reasoning_gym section)")
        return self

    @property
    def has_held_out(self) -> bool:
        """Whether the run has held-out prompts to evaluate on."""
        if self.source == "reasoning_gym":
            return bool(self.reasoning_gym and self.reasoning_gym.eval_size)
        return self.source == "environment" or bool(self.eval_path)  # an environment may have them

    def describe(self, split: str = "train") -> str:
        """Where the `split` ("train" or "eval") prompts come from, for messages."""
        if self.source != "files":
            return f"data.source {self.source} ({split})"
        return f"data.train_path ({self.train_path})" if split == "train" else f"data.eval_path ({self.eval_path})"


class SaverConfig(Section):
    freq_steps: int | None = Field(None, ge=1)
    """Checkpoint every this many steps (None = not by steps)."""
    freq_secs: float | None = Field(None, gt=0)
    """Checkpoint every this many seconds (None = not by time)."""
    keep_last: int = Field(2, ge=1)
    """Complete checkpoints kept; older ones are deleted."""
    export_hf_at_end: bool = True
    """Export the final model as a Hugging Face directory (`final_model`; with `actor.lora`, the
    PEFT adapter directory)."""
    export_merged_at_end: bool = False
    """With `actor.lora`: also export the base with the adapter merged in, a full Hugging Face
    directory any server loads without LoRA support (`final_model_merged`)."""


class RecoverConfig(Section):
    mode: Literal["auto", "disabled", "required"] = "auto"
    """`auto`: resume if a checkpoint exists; `disabled`: always start fresh; `required`: fail without one."""
    allow_pickle: bool = False
    """Resume from a checkpoint whose rollout state holds Python objects other than tensors and
    plain data (e.g. dataset items of your own classes). Off: such a file is refused, since
    unpickling it could run code; turn on only for a run directory no one else can write."""


class CriticConfig(Section):
    enabled: bool = False
    """Train a value model (PPO with a critic); needed by, and only used with, `algorithm.adv_estimator: gae`."""
    model_path: str | None = None
    """Hugging Face model directory of the critic's backbone (None = `actor.model_path`); a
    scalar value head is added on top."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute dtype, as `actor.dtype`."""
    optimizer: OptimizerConfig = Field(default_factory=lambda: OptimizerConfig(lr=1e-5))
    """The critic's own optimizer and LR schedule."""
    mb_max_tokens: int = Field(8192, ge=1)
    """Token budget of one packed micro-batch."""
    attn_impl: Literal["auto", "varlen", "flex", "sdpa_loop"] = "auto"
    """Attention over packed sequences, as `actor.attn_impl`."""
    sp_size: int = Field(1, ge=1)
    """Sequence-parallel ranks, as `actor.sp_size`."""
    tp_size: int = Field(1, ge=1)
    """Tensor-parallel ranks, as `actor.tp_size`."""
    ep_size: int = Field(1, ge=1)
    """Expert-parallel ranks for a mixture-of-experts backbone, as `actor.ep_size`."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    value_clip: float | None = Field(0.2, gt=0)
    """Clip range of the value update around the old values (PPO2's clipped value loss); null = unclipped."""


class EvaluationConfig(Section):
    freq_steps: int | None = Field(None, ge=1)
    """Greedy evaluation on `data.eval_path` every this many steps (None = only at start and end)."""
    max_prompts: int | None = Field(None, ge=1)
    """Evaluate on at most this many held-out prompts (None = all)."""
    max_new_tokens: int | None = Field(None, gt=0)
    """Token limit of evaluation samples (None = `generation.max_new_tokens`)."""
    n_samples: int = Field(1, ge=1)
    """Besides greedy accuracy: this many sampled answers per held-out prompt, scored as
    pass@k and mean@k (k = 1, 2, 4, ... up to `n_samples`); 1 = greedy only."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of the `n_samples` evaluation answers."""


class WandbConfig(Section):
    mode: Literal["disabled", "online", "offline"] = "disabled"
    """W&B mode; disabled by default."""
    project: str = "arealite"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user)."""


class StatsConfig(Section):
    tensorboard: bool = False
    """Also write TensorBoard event files under the run directory."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases logging."""
    plot: bool = True
    """Write `reward_curve.png` under the run directory at the end."""
    progress_bar: bool = True
    """Show a progress bar with step, reward and accuracy."""


class WeightSyncConfig(Section):
    method: Literal["distributed", "disk", "shm"] = "distributed"
    """`distributed`: broadcast over a process group (gloo on CPU, NCCL on CUDA); `disk`: safetensors directory;
    `shm`: one shared-memory file reused by every update (embedded servers on the trainer's host only; fastest there)."""
    bucket_size_mb: float = Field(64.0, gt=0)
    """Tensors are sent in buckets of about this size."""
    verify_n_tensors: int = Field(2, ge=0)
    """Tensors read back with `get_weights_by_name` after each update and compared (on servers whose
    model class can read weights back; SGLang cannot for Qwen2, for example)."""
    probe: bool = True
    """After each update, every server scores a fixed token sequence and must agree with the trainer's
    forward (the log-prob probe; works on every model). Logs `probe_mean_abs_diff`, `probe_max_abs_diff`
    and `probe_k3` every step: the train/inference mismatch."""
    probe_every: int = Field(1, ge=1)
    """Run the probe on every this-many-th version (it costs a forward on each side)."""
    probe_tokens: int = Field(32, ge=2)
    """Length of the probe's token sequence (the first training prompt, padded with seeded ids)."""
    probe_tolerance: float | None = Field(None, gt=0)
    """Largest mean absolute log-prob difference a server may show on the probe (None = 1e-3 for
    float32 servers, 5e-2 for bfloat16/float16 ones)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend for the distributed method (auto = nccl on CUDA, else gloo)."""
    timeout_s: float = Field(120.0, gt=0)
    """Timeout of one weight update, and of the embedded servers' weight-update group (a server still
    receiving from a group whose member died stays stuck that long: SGLang's scheduler does the same
    until its own collective timeout)."""
    disk_dir: str | None = None
    """Scratch directory of the disk method (None = under the run directory)."""
    shm_dir: str = "/dev/shm"
    """Directory of the shm method's weight file (a tmpfs, so that it lives in RAM)."""
    shm_alias: bool = True
    """shm method: the servers serve straight out of the trainer's files (no copy on their side; two files,
    written in turn); false: one file the servers copy out of at each update."""


class ArealiteConfig(Section):
    """The whole configuration of one arealite run."""

    experiment: ExperimentConfig = Field(default_factory=ExperimentConfig)
    """Name, output directory and seed."""
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    """Processes the launchers start (local, Ray, Slurm)."""
    server: ServerConfig = Field(default_factory=ServerConfig)
    """Inference servers."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Rollout controller: concurrency, queues, staleness, retries, faults."""
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    """Sampling of training rollouts (evaluation overrides it to greedy)."""
    actor: ActorConfig = Field(default_factory=ActorConfig)
    """The trained policy and its train engine."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Rewards, advantages, PPO/GRPO loss."""
    critic: CriticConfig = Field(default_factory=CriticConfig)
    """The value model of PPO with a critic (`algorithm.adv_estimator: gae`)."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Datasets and the dataloader."""
    saver: SaverConfig = Field(default_factory=SaverConfig)
    """Periodic checkpoints."""
    recover: RecoverConfig = Field(default_factory=RecoverConfig)
    """Resuming a killed run."""
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    """Periodic greedy evaluation on held-out prompts."""
    stats: StatsConfig = Field(default_factory=StatsConfig)
    """Stats logging and plots."""
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    """How new weights reach the inference servers."""
    agent: AgentConfig = Field(default_factory=AgentConfig)
    """Agentic RL: the OpenAI-compatible endpoint agents call, the code sandbox, the LLM judge."""
