"""One inference server's memory, per GPU: weights at the serving dtype, the KV cache, and hence
how many tokens of KV it holds and how many answers of the run's maximum length run at once.

- **SGLang** (`launch.server_backend: sglang`) sizes a KV pool once at start (0.5.21,
  docs/sglang.md "How SGLang sizes its KV cache"): with ``B`` the free memory measured before
  the weights load, the pool gets what is free after loading less ``B x (1 - mem_fraction_static)``,
  ``max_total_num_tokens = that // cell``, ``cell = kv_heads per GPU x (K + V head dims) x layers x
  KV dtype bytes``; ``max_running_requests`` defaults from it.
- **The embedded server** sizes nothing: it admits up to ``server.max_batch_size`` rows of at most
  ``context_length`` tokens each, and its KV cache (a padded ``[rows, kv_heads, T, head_dim]``
  tensor per layer, ``T`` the longest row) grows as they decode. Its capacity is that admission
  bound (`ServerArgs.served_context_length`, the rule the server itself runs); its memory is
  what that many rows of the run's lengths hold, and nothing stops it past the card.
- **Simulated servers** hold nothing; their cost model's capacity is reported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache

from arealite.config.schema import ArealiteConfig
from arealite.server.command_line import embedded_server_command, server_model_path
from arealite.server.args import parse_args
from arealite.server.prompt_cache import DEFAULT_MAX_BYTES
from arealite.sim.cost_model import GpuSpec, SimSpec

from .breakdown import GIB, MemoryBreakdown

__all__ = ["ModelSize", "ServerPlan", "model_size", "read_model_config", "server_memory"]

#: CUDA context, NCCL and torch's own start-up allocations of an SGLang process, taken before
#: SGLang measures its free memory (so outside the pool and the slack). Assumed, not measured.
RUNTIME_RESERVED_GIB = 1.0

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}


@dataclass(frozen=True)
class ModelSize:
    """What a server's memory and speed depend on, read from the model built on the meta device."""

    params: int
    """Every parameter (tied embeddings once)."""
    matmul_params: int
    """Parameters of the linear layers a token runs, the output head included (what a token's
    FLOPs count; a mixture of experts' experts at the top-k share a token activates)."""
    layers: int
    kv_heads: int
    head_dim: int
    attn_heads: int
    vocab: int

    def kv_values_per_token(self, tp: int = 1) -> int:
        """K and V values one token keeps, over all layers, on one of ``tp`` GPUs (heads split,
        at least one per GPU: SGLang's ``get_num_kv_heads``)."""
        return 2 * max(1, self.kv_heads // tp) * self.head_dim * self.layers


def read_model_config(cfg: ArealiteConfig) -> dict:
    """The served model's config.json (``server.model_path``, else ``actor.model_path``): a
    directory holding only config.json is enough."""
    path = server_model_path(cfg)
    try:
        with open(f"{path}/config.json", encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"server.model_path / actor.model_path {path!r}: cannot read its config.json ({e})") from None


def model_size(hf_config: dict) -> ModelSize:
    """Counts from the model built on the meta device (no memory, no weights)."""
    return _model_size(json.dumps(hf_config, sort_keys=True))


@lru_cache(maxsize=8)
def _model_size(config_json: str) -> ModelSize:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    d = json.loads(config_json)
    hf = AutoConfig.for_model(**d)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    params = sum(p.numel() for p in model.parameters())
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    text = d.get("text_config") or d
    # A mixture of experts' fused expert weights are not Linear modules; a token runs top-k of them.
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    n_experts = text.get("num_experts") or text.get("num_local_experts")
    if experts and n_experts:
        matmul += experts * int(text.get("num_experts_per_tok") or 1) // int(n_experts)
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
    return ModelSize(params=params, matmul_params=matmul, layers=int(text["num_hidden_layers"]),
                     kv_heads=int(text.get("num_key_value_heads") or heads), head_dim=head_dim,
                     attn_heads=heads, vocab=int(text["vocab_size"]))


@dataclass
class ServerPlan:
    """One server's memory on one of its GPUs and what it can run."""

    backend: str
    breakdown: MemoryBreakdown
    kv_tokens: int
    """KV capacity in tokens: SGLang's pool (``max_total_num_tokens``); the embedded server's
    admission bound, ``max_batch_size x context_length``; the simulator's own figure."""
    concurrent_answers: int
    """Answers of ``answer_tokens`` (prompt + max_new_tokens) that run at once."""
    answer_tokens: int
    max_running_requests: int
    gpus: int
    """GPUs of one server (SGLang's tp_size)."""
    capacity_bytes: int
    """One GPU's memory."""
    problems: list[str] = field(default_factory=list)
    """Why the server cannot run the configured answers (empty when it can)."""

    @property
    def fits(self) -> bool:
        return not self.problems

    def table(self) -> str:
        lines = [self.breakdown.table(self.capacity_bytes),
                 f"  KV capacity {self.kv_tokens:,} tokens; {self.concurrent_answers} answers of "
                 f"{self.answer_tokens:,} tokens at once (max running requests {self.max_running_requests})"]
        lines += [f"  note: {n}" for n in self.breakdown.notes]
        lines += [f"  PROBLEM: {p}" for p in self.problems]
        return "\n".join(lines)


def answer_tokens(cfg: ArealiteConfig) -> int:
    """The configured longest answer: ``data.max_prompt_len`` + ``generation.max_new_tokens``."""
    return (cfg.data.max_prompt_len or 0) + cfg.generation.max_new_tokens


def server_memory(cfg: ArealiteConfig, gpu: GpuSpec, hf_config: dict | None = None, *,
                  runtime_reserved_gib: float = RUNTIME_RESERVED_GIB) -> ServerPlan:
    """The memory of one server of ``cfg`` on a ``gpu`` (its ``memory_gb`` read as GiB; see
    `arealite.plan.gpus.Cluster.memory_bytes`), for the model of ``hf_config`` (default: the
    served model's config.json)."""
    hf_config = hf_config if hf_config is not None else read_model_config(cfg)
    backend = cfg.launch.server_backend
    if backend == "sglang":
        plan = _sglang(cfg, gpu, hf_config, runtime_reserved_gib)
    elif backend == "sim":
        plan = _simulated(cfg, gpu)
    else:
        plan = _embedded(cfg, gpu, hf_config)
    if not cfg.data.max_prompt_len:
        plan.breakdown.notes.append("data.max_prompt_len is unset: answers are counted as max_new_tokens "
                                    "alone; set it for the prompt's share")
    return plan


def _sglang(cfg: ArealiteConfig, gpu: GpuSpec, hf_config: dict, reserved_gib: float) -> ServerPlan:
    o = cfg.server.sglang
    tp = o.tp_size
    size = model_size(hf_config)
    dtype = "bfloat16" if cfg.server.dtype == "auto" else cfg.server.dtype  # as the launcher passes it
    kv_dtype = _flag(o.extra_args, "--kv-cache-dtype") or "auto"
    kv_dtype = {"auto": dtype, "bf16": "bfloat16", "mxfp8": "fp8_e4m3"}.get(kv_dtype, kv_dtype)
    if kv_dtype not in _DTYPE_BYTES:
        raise ValueError(f"server.sglang.extra_args: --kv-cache-dtype {kv_dtype!r} is not one the planner "
                         f"knows ({', '.join(_DTYPE_BYTES)})")
    capacity = int(gpu.memory_gb * GIB)
    reserved = int(reserved_gib * GIB)
    before_load = capacity - reserved  # SGLang's pre_model_load_memory
    weights = size.params * _DTYPE_BYTES[dtype] // tp
    slack = int(before_load * (1 - o.mem_fraction_static))
    cell = size.kv_values_per_token(tp) * _DTYPE_BYTES[kv_dtype]
    page = int(_flag(o.extra_args, "--page-size") or 1)
    rest = before_load - weights - slack
    tokens = max(rest, 0) // cell // page * page
    user_cap = _flag(o.extra_args, "--max-total-tokens")
    if user_cap is not None:
        tokens = min(tokens, int(user_cap))
    context = int(o.context_length or cfg.server.context_length or _text(hf_config).get("max_position_embeddings")
                  or 4096)
    max_running = _sglang_max_running(tokens, context, _flag(o.extra_args, "--max-running-requests"))
    answer = answer_tokens(cfg)
    b = MemoryBreakdown(f"server (sglang, per GPU of tp_size={tp})")
    b.add("runtime (CUDA context, NCCL; assumed)", reserved)
    b.add(f"weights ({dtype}, 1/{tp} of {size.params / 1e9:.2f}B)", weights)
    b.add(f"KV cache pool ({tokens:,} tokens x {cell:,} B)", tokens * cell)
    b.add(f"outside mem_fraction_static {o.mem_fraction_static} (activations, CUDA graphs)", slack)
    b.notes.append("SGLang 0.5.21's rule (docs/sglang.md); the pool is allocated at start whatever the load")
    problems = []
    if rest <= 0:
        need = 1 - (before_load - weights) / before_load
        problems.append(f"the weights ({weights / GIB:.1f} GiB per GPU) leave no KV cache under "
                        f"server.sglang.mem_fraction_static={o.mem_fraction_static}: raise it above {need:.3f} "
                        "or raise server.sglang.tp_size")
    concurrent = min(max_running, tokens // answer) if answer else max_running
    if not problems and concurrent < 1:
        problems.append(f"the KV pool ({tokens:,} tokens) holds no answer of {answer:,} tokens: raise "
                        "server.sglang.mem_fraction_static or server.sglang.tp_size, or lower "
                        "generation.max_new_tokens")
    return ServerPlan("sglang", b, tokens, concurrent, answer, max_running, tp, capacity, problems)


def _sglang_max_running(tokens: int, context: int, flag: str | None) -> int:
    """SGLang's ``resolve_max_num_reqs``: the flag, or ``tokens / context x 512`` held within
    2048-4096; never above half the pool's tokens."""
    if flag is not None:
        return min(int(flag), tokens // 2)
    return min(max(min(int(tokens / context * 512), 4096), 2048), tokens // 2)


def _embedded(cfg: ArealiteConfig, gpu: GpuSpec, hf_config: dict) -> ServerPlan:
    # The server's own arguments, from the command line the launcher gives it.
    path = cfg.server.model_path or cfg.actor.model_path or "."  # only its config is read here
    args = parse_args(embedded_server_command(cfg, port=1, model_path=path)[3:])
    context = args.served_context_length(hf_config)
    dtype = args.served_dtype_name(hf_config)
    size = model_size(hf_config)
    nbytes = _DTYPE_BYTES[dtype]
    per_token = size.kv_values_per_token() * nbytes
    answer = answer_tokens(cfg)
    rows = args.max_batch_size
    held = min(answer, context)
    b = MemoryBreakdown("server (embedded)")
    b.add(f"weights ({dtype}, {size.params / 1e9:.3f}B)", size.params * nbytes)
    b.add(f"KV cache ({rows} rows x {held:,} tokens)", rows * held * per_token)
    b.add("KV copy of one layer (join, append, leave)", rows * held * per_token // size.layers)
    prompt = cfg.data.max_prompt_len or 0
    b.add(f"prompt cache (<= {args.prompt_cache_entries} prompts)",
          min(args.prompt_cache_entries * (prompt * per_token + size.vocab * nbytes), DEFAULT_MAX_BYTES))
    b.add("logits of one decode step", rows * size.vocab * (nbytes + 4))
    b.notes.append("no memory pool: up to server.max_batch_size rows run whatever the card holds (an "
                   "over-full card fails the batch with out-of-memory); rows are padded to the longest")
    b.notes.append("not modelled: the prefill's activations, CUDA context, allocator fragmentation")
    problems = []
    capacity = int(gpu.memory_gb * GIB)
    if b.total > capacity:
        problems.append(f"{b.total / GIB:.1f} GiB predicted on a {capacity / GIB:.0f} GiB card: lower "
                        "server.max_batch_size or use launch.server_backend=sglang")
    if answer > context:
        problems.append(f"answers of {answer:,} tokens exceed the server's context length {context:,} "
                        "(server.context_length, or the model's max_position_embeddings)")
    return ServerPlan("embedded", b, rows * context, rows if answer <= context else 0, answer, rows, 1,
                      capacity, problems)


def _simulated(cfg: ArealiteConfig, gpu: GpuSpec) -> ServerPlan:
    o = cfg.server.sim
    spec = SimSpec(gpu=o.gpu, model=o.model, gpus_per_server=o.gpus_per_server, mem_fraction=o.mem_fraction)
    answer = answer_tokens(cfg)
    tokens = spec.kv_capacity_tokens
    b = MemoryBreakdown(f"server (simulated {o.model} on {o.gpus_per_server} x {o.gpu})")
    b.notes.append("a simulated server holds no GPU memory; its cost model's KV capacity is shown "
                   "(server.sim: GB as 1e9 bytes, docs/scale.md)")
    rows = cfg.server.max_batch_size
    return ServerPlan("sim", b, tokens, min(rows, tokens // answer), answer, rows, o.gpus_per_server,
                      int(gpu.memory_gb * GIB))


def _text(hf_config: dict) -> dict:
    return hf_config.get("text_config") or hf_config


def _flag(args: list[str], name: str) -> str | None:
    """The value of ``name`` in SGLang's extra arguments (``--name V`` or ``--name=V``)."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None
