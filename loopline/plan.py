"""`loopline plan`: the memory each role's rank will hold and the step's FLOPs, from the config alone (nothing
starts, no torch imported), checked against the memory of the node it runs on.

Per rank, the terms (bytes):
- runtime: the Python process with torch and transformers imported (measured here, RUNTIME_BYTES);
- params, optimizer: the model's parameters at model.dtype and AdamW's two fp32 moments, held throughout; a
  trainer's are sharded over runtime.trainer_ranks (FSDP2); LoRA trains (and keeps moments of) the adapters only;
- a trainer's step has two peaks, and a rank is planned at the larger (trainer_terms). Backward's start: compute_copy
  (training.mixed_precision=bf16: the bf16 copy of the fp32 master weights its forwards run on; it also halves
  the activations), the activations forward kept (ModelShape.act_floats_per_token floats a token per decoder
  layer; under training.activation_checkpointing full each layer's input only, selective every other layer's),
  the head's gradient (grads: the first one backward makes), and the larger of the logits and one layer's
  backward (its activations' gradients, a checkpointed layer recomputed). Backward's end and the update: every
  gradient (grads) and the larger of a tied embedding's gradient before it is summed into the head's and AdamW's
  temporaries for one chunk of the step (training/optim.py step_in_chunks): update;
- logits: one micro-batch's fp32 logits over every position (the head's output; in backward its gradient
  replaces it), and over the response's tokens their log-softmax, its gradient and the slice's gradient:
  rows x (tokens + LOGITS_COPIES x response tokens) x vocab x 4 bytes; chunked log-probs (model.logits_chunk_tokens)
  hold one chunk of the rows' tokens flattened and its copies; a frozen model's forward keeps two (logits, log-softmax);
- kv_cache: an engine's keys and values for its rows at prompt + completion length, the rows a step or the
  held-out scoring runs at once (vLLM: its reserved cache); packed: a CPU torch engine's reordered copy of its
  linear weights while it generates (rollout.pack_weights);
- sandbox: a code env worker's sandbox memory cap. A trainer rank's spare (ray): runtime (a warm process) or params too.
A rank's terms are summed. On the local backend the model roles share one process and work in turn (generate,
then score, then train): the process holds every role's resident terms (params, optimizer) and the working terms
(the rest) of one role at a time, the largest. Calibrated against measured peaks (docs/guide/memory-plan.md). On a
pool with GPUs the host holds the runtime and one staged copy of the weights; one bundle's GPU memory is a node
of its own (gpu_node), checked against the pool's gpu_memory_gib when declared.

FLOPs: 6 x params x tokens for a training pass, 2 x params x tokens for generation and log-prob forwards (an MoE
model's active parameters: a token computes with its top-k experts only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from loopline.config import RunConfig
from loopline.errors import UserError
from loopline.models.shape import ModelShape, shape_of
from loopline.rollout.config import PACK_MIN_NEW_TOKENS
from loopline.training.config import STEP_CHUNK_BYTES, DPOConfig, GRPOConfig, RewardModelConfig, SFTConfig

if TYPE_CHECKING:
    from loopline.distributed.placement import PoolConfig

GIB = 2**30
MIB = 2**20
# Measured here (2026-12-04): `python -c "import torch, transformers, loopline.commands"` peaks at 357 MiB
# (/usr/bin/time -v); a local run's main process adds its data, batches and allocator slack, and the spawn
# start method's resource tracker (12 MiB): fitted to the calibration runs of docs/guide/memory-plan.md.
RUNTIME_BYTES = 400 * MIB
# A local env worker: a spawned process that imports the env code only (measured 36 MiB).
ENV_WORKER_BYTES = 40 * MIB
RAY_HEAD_BYTES = 1 * GIB  # the head node's GCS, raylet and dashboard agent
RAY_NODE_BYTES = GIB // 2  # a worker node's raylet
LOGITS_COPIES = 3  # over the response's tokens: log-softmax, its gradient, the sliced logits' gradient
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TRAINER_ROLES = ("actor", "critic")
PHASES = {"train": ("sft", "grpo"), "sft": ("sft",), "dpo": ("sft", "dpo"), "rm": ("sft", "rm")}


def model_shape(cfg: RunConfig) -> ModelShape:
    """The policy's shape (loopline.models.shape)."""
    return shape_of(cfg.model)


def logits_bytes(cfg: RunConfig, rows: int, seq: int, response: int, copies: int, vocab: int) -> int:
    """Float32 logits a forward of `rows` rows holds at once: the head's output over every position and `copies`
    more over the response's; with model.logits_chunk_tokens (chunked log-probs) one chunk of the response's
    tokens, counted over every row (the chunks run over rows x tokens flattened), and its copies."""
    chunk = cfg.model.logits_chunk_tokens
    if chunk:
        return min(chunk, rows * response) * (1 + copies) * vocab * 4
    return rows * (seq + copies * response) * vocab * 4


def eval_prompts(cfg: RunConfig) -> int:
    """Prompts an engine generates for at once when it scores the held-out set: eval.batch_size, at most
    eval.num_prompts and the held-out split (data.task.num_eval for the built-in task; none for a file source
    without data.eval_path)."""
    prompts = min(cfg.eval.batch_size, cfg.eval.num_prompts)
    if cfg.data.source == "builtin" and not cfg.env.has_builtin_rows:
        return min(prompts, cfg.data.task.num_eval)
    return prompts if cfg.data.source == "builtin" or cfg.data.eval_path else 0


def activation_checkpointing(cfg: RunConfig) -> str:
    """training.activation_checkpointing: none, full or selective."""
    return cfg.training.activation_checkpointing


# ---------------------------------------------------------------------------------------------------------
# Lengths and rows of each phase
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """One training phase's micro-batch on a trainer rank and its step's rows and lengths."""

    name: str
    micro_rows: int  # sequences per forward/backward on one rank
    seq: int  # tokens of the longest sequence
    step_rows: int  # sequences trained per optimizer step (all ranks)
    generated_rows: int  # sequences generated per step (0: none)
    new_tokens: int  # tokens generated per sequence
    forwards: int  # log-prob forwards per step besides training (old policy, reference)
    response: int  # tokens of a row whose log-probs are taken (the completion)
    vocab_logits: bool = True  # False: a scalar head (reward model)


def _builtin_task(cfg: RunConfig) -> bool:
    """The built-in 'a+b=' rows (the code env's built-in rows are its own)."""
    return cfg.data.source == "builtin" and not cfg.env.long_builtin_prompts


def prompt_tokens(cfg: RunConfig, shape: ModelShape) -> int:
    """Longest prompt: the built-in task's 'a+b=' with bos, else data.max_prompt_tokens or the model's positions
    less the completion."""
    if _builtin_task(cfg):
        return 1 + 2 * cfg.data.task.max_digits + 2
    if cfg.data.max_prompt_tokens:
        return cfg.data.max_prompt_tokens
    return max(1, shape.max_positions - cfg.grpo.sampling.max_new_tokens)


def sft_tokens(cfg: RunConfig, shape: ModelShape) -> int:
    """Longest SFT row (prompt + target): the built-in task's, else data.max_seq_len or the model's positions."""
    if _builtin_task(cfg):
        return prompt_tokens(cfg, shape) + cfg.data.task.max_digits + 3
    return min(cfg.data.max_seq_len or shape.max_positions, shape.max_positions)


def length_hint(cfg: RunConfig) -> str:
    """What to add to a hint when the rows' lengths were assumed from the model's positions (no limit given)."""
    if _builtin_task(cfg) or (cfg.data.max_prompt_tokens and cfg.data.max_seq_len):
        return ""
    return "; rows are assumed as long as the model's positions: data.max_prompt_tokens and data.max_seq_len set them"


def target_tokens(cfg: RunConfig, shape: ModelShape) -> int:
    """Longest SFT target (the tokens with a loss): the built-in task's answer and newline, else the whole row."""
    if _builtin_task(cfg):
        return cfg.data.task.max_digits + 2
    return sft_tokens(cfg, shape)


def rows_per_micro(
    section: SFTConfig | GRPOConfig | DPOConfig | RewardModelConfig, rows: int, seq: int
) -> int:
    """Rows of one micro-batch on a rank: micro_batch_size, or under max_tokens_per_micro_batch as many rows of the
    longest length `seq` as the budget holds (its padded tokens are what the activations scale with)."""
    budget = section.max_tokens_per_micro_batch
    return min(max(1, budget // seq) if budget else section.micro_batch_size, rows)


def phases(cfg: RunConfig, command: str, shape: ModelShape) -> list[Phase]:
    """The phases `command` runs, each with its micro-batch."""
    ranks = cfg.runtime.trainer_ranks
    out = []
    for name in PHASES[command]:
        if name == "sft" and cfg.sft.steps:
            s = cfg.sft
            seq = sft_tokens(cfg, shape)
            out.append(Phase("sft", rows_per_micro(s, s.batch_size // ranks, seq), seq,
                             s.batch_size, 0, 0, 0, target_tokens(cfg, shape)))  # fmt: skip
        elif name == "grpo" and cfg.grpo.steps:
            g = cfg.grpo
            rows = g.prompts_per_step * g.group_size
            seq = min(prompt_tokens(cfg, shape) + g.sampling.max_new_tokens, shape.max_positions)
            # the old policy's forward runs only where the loop needs it (loops/grpo.py): more than one update per
            # batch, a KL in the reward, or the engine's log-probs compared with the trainer's
            old = (g.epochs_per_step * g.minibatches > 1 or g.kl_in == "reward"
                   or g.behaviour_correction != "none" or cfg.engine_dtype != cfg.compute_dtype)  # fmt: skip
            forwards = int(old) + (g.kl_coef > 0)
            out.append(Phase("grpo", rows_per_micro(g, rows // ranks // g.minibatches, seq), seq,
                             rows * g.epochs_per_step, rows, g.sampling.max_new_tokens, forwards,
                             min(g.sampling.max_new_tokens, seq)))  # fmt: skip
        elif name in ("dpo", "rm"):
            p = getattr(cfg, name)
            pairs = rows_per_micro(p, p.batch_size // ranks, sft_tokens(cfg, shape))
            out.append(Phase(name, 2 * pairs, sft_tokens(cfg, shape), 2 * p.batch_size, 0, 0,
                             2 if name == "dpo" else 0, target_tokens(cfg, shape), vocab_logits=name != "rm"))  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------------------
# Terms per rank
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Term:
    """One part of a rank's memory and the setting that shrinks it; `working`: held only while its role works (a
    step's activations, an engine's KV cache), not between its turns."""

    name: str
    nbytes: int
    shrink: str
    working: bool = False


def activation_bytes(cfg: RunConfig, shape: ModelShape, rows: int, seq: int) -> tuple[int, int]:
    """(kept, layer): what forward leaves for backward of one micro-batch's decoder layers (fp32 compute) at the
    chosen checkpointing, and what backward adds while it goes through one layer (the gradients of its
    activations; a checkpointed layer's activations recomputed as well)."""
    tokens = rows * seq
    word = 2 if cfg.training.mixed_precision == "bf16" else 4  # bytes of an activation: bf16 compute or fp32
    full_layer = tokens * shape.act_floats_per_token * word
    kept_input = tokens * shape.hidden * word
    mode = activation_checkpointing(cfg)
    # a checkpointed layer keeps its input; while backward recomputes it, its activations exist again
    checkpointed = {"none": 0, "full": shape.layers, "selective": shape.layers // 2}[mode]
    kept = (shape.layers - checkpointed) * full_layer + checkpointed * kept_input
    return kept, full_layer * (checkpointed > 0) + full_layer


def compute_copy_bytes(cfg: RunConfig, shape: ModelShape) -> int:
    """training.mixed_precision=bf16: the bf16 copy of the fp32 master weights that forwards and backwards run on
    (locally the whole model's through a step; on FSDP2 ranks counted as a shard's worth); 0 without it."""
    return shape.params * 2 if cfg.training.mixed_precision == "bf16" else 0


def trainer_terms(cfg: RunConfig, shape: ModelShape, phase: Phase) -> list[Term]:
    """A trainer rank's memory in one phase, at the larger of a step's two peaks. Backward's start: forward's kept
    activations, the head's gradient (the first one backward makes), and the larger of the logits (freed once the
    head's backward is done) and one decoder layer's backward. Backward's end and the update: every gradient and
    the larger of a tied embedding's own before it is summed into the head's (a whole one, also on FSDP2 ranks,
    where the root's gradients are reduce-scattered from whole ones) and AdamW's temporaries, one chunk's of the
    step (the root of its second moments: a chunk of STEP_CHUNK_BYTES, or the largest tensor alone); the
    activations are gone. Calibrated in docs/guide/memory-plan.md."""
    width = DTYPE_BYTES[cfg.model.dtype]
    ranks = cfg.runtime.trainer_ranks
    lora = cfg.model.lora
    trainable = shape.lora_params(lora.r, lora.target_modules) if lora.r else shape.params
    budgeted = getattr(cfg, phase.name).max_tokens_per_micro_batch
    micro = f"{phase.name}.{'max_tokens_per_micro_batch' if budgeted else 'micro_batch_size'}"
    logits = 0
    if phase.vocab_logits:  # the head's output over every position, then copies over the response's
        logits = logits_bytes(cfg, phase.micro_rows, phase.seq, phase.response, LOGITS_COPIES, shape.vocab)
    more_ranks = "more runtime.trainer_ranks (FSDP2 shards it" + (
        ", on runtime.backend=ray)" if cfg.runtime.backend == "local" else ")"
    )
    adapters = f"model.lora.r=8 (adapters only) or {more_ranks}"
    kept, layer = activation_bytes(cfg, shape, phase.micro_rows, phase.seq)
    head = 0 if lora.r or not phase.vocab_logits else shape.vocab * shape.hidden * width // ranks
    grads = trainable * width // ranks
    tied = shape.vocab * shape.hidden * width if head and shape.tied else 0
    largest = (shape.vocab * shape.hidden if head else shape.hidden * shape.intermediate) * 4 // ranks
    update = max(tied, min(trainable * 4 // ranks, max(STEP_CHUNK_BYTES, largest)))
    backward = compute_copy_bytes(cfg, shape) // ranks + kept + head + max(logits, layer)
    in_backward = backward > grads + update
    acts = f"training.activation_checkpointing=full or a smaller {micro}{length_hint(cfg)}"
    return [
        Term("params", shape.params * width // ranks, f"model.dtype=bfloat16 or {more_ranks}"),
        Term("optimizer", trainable * 4 * 2 // ranks, adapters),
        Term("grads", head if in_backward else grads, adapters, working=True),
        Term("update", 0 if in_backward else update, adapters, working=True),
        Term("compute_copy", compute_copy_bytes(cfg, shape) // ranks if in_backward else 0,
             "training.mixed_precision=none", working=True),  # fmt: skip
        Term("activations", kept + (layer if layer > logits else 0) if in_backward else 0, acts, working=True),
        Term("logits", logits if in_backward and logits >= layer else 0,
             f"a smaller {micro} (or chunked log-probs: model.logits_chunk_tokens){length_hint(cfg)}", working=True),
    ]  # fmt: skip


def engine_terms(cfg: RunConfig, shape: ModelShape, phase: Phase | None) -> list[Term]:
    """An engine's memory: its own copy of the weights (none when it shares the local actor's) and the KV cache of
    the rows it runs at once (a step's, or the held-out prompts it scores at once, whichever holds more tokens; at
    most runtime.engine_max_rows each), in its dtype (rollout.dtype). The advice names what sizes the larger."""
    width, cap, engines = DTYPE_BYTES[cfg.engine_dtype], cfg.runtime.engine_max_rows, cfg.runtime.engines
    step = math.ceil(phase.generated_rows / engines) if phase else 0
    held_out = math.ceil(eval_prompts(cfg) / engines)
    eval_seq = min(prompt_tokens(cfg, shape) + cfg.eval.sampling.max_new_tokens, shape.max_positions)
    rows_max = "runtime.engine_max_rows (rows an engine runs at once)"
    held = f"eval.batch_size (held-out prompts generated at once) or {rows_max}"
    tokens, shrink = max((min(step, cap or step) * (phase.seq if phase else 0), rows_max),
                         (min(held_out, cap or held_out) * eval_seq, held), key=lambda ts: ts[0])  # fmt: skip
    kv = tokens * shape.layers * 2 * shape.kv_heads * shape.head_dim * width
    shrink += length_hint(cfg)
    if cfg.rollout.engine == "vllm":  # vLLM on CPU reserves a KV cache of its own size, whatever the rows
        kv, shrink = cfg.rollout.vllm.cpu_kv_cache_gib * GIB, "rollout.vllm.cpu_kv_cache_gib"
    # a local engine on the actor's own parameters (rollout.share_weights) holds no weights of its own
    params = 0 if cfg.engine_shares_weights else shape.params * width
    return [
        Term("params", params, "rollout.dtype=bfloat16"),
        Term("kv_cache", kv, shrink, working=True),
        Term("packed", packed_bytes(cfg, shape, phase), "rollout.pack_weights=never", working=True),
    ]


def packed_bytes(cfg: RunConfig, shape: ModelShape, phase: Phase | None) -> int:
    """rollout.pack_weights: while a torch engine on a CPU generates at least PACK_MIN_NEW_TOKENS tokens, a copy
    of its float32 linear weights (every weight but the input embeddings and the norms; a tied head is one)."""
    new = max(phase.new_tokens if phase else 0, cfg.eval.sampling.max_new_tokens if eval_prompts(cfg) else 0)
    if not cfg.engine_packs_weights or new < PACK_MIN_NEW_TOKENS:
        return 0
    return (shape.params - (0 if shape.tied else shape.vocab * shape.hidden)) * 4


def frozen_terms(cfg: RunConfig, shape: ModelShape, role: str, phase: Phase | None) -> list[Term]:
    """A reference's or reward model's memory: frozen weights (the reference sharded like the actor) and one
    forward's logits."""
    width = DTYPE_BYTES[cfg.model.dtype]
    shards = cfg.runtime.trainer_ranks if role == "ref" else 1
    rows = phase.micro_rows if phase else cfg.grpo.micro_batch_size
    seq = phase.seq if phase else prompt_tokens(cfg, shape)
    # the reference's log-probs (no gradient): the logits over every position and their log-softmax
    logits = logits_bytes(cfg, rows, seq, seq, 1, shape.vocab) if role == "ref" else 0
    return [
        Term("params", shape.params * width // shards, "model.dtype=bfloat16"),
        Term(
            "logits", logits, "a smaller grpo.micro_batch_size (or model.logits_chunk_tokens)", working=True
        ),
    ]


def wanted_roles(cfg: RunConfig, command: str) -> list[str]:
    """The model roles a run has besides actor and rollout."""
    roles = []
    if command == "train" and cfg.grpo.advantage == "gae":
        roles.append("critic")
    if (command == "train" and cfg.grpo.kl_coef > 0) or (command == "dpo" and cfg.dpo.reference == "online"):
        roles.append("ref")
    if command == "train" and cfg.reward.source != "verifier":
        roles.append("reward")
    return roles


def role_terms(cfg: RunConfig, role: str, command: str = "train") -> list[Term]:
    """One rank of `role`, besides its process's runtime: its largest phase."""
    shape = model_shape(cfg)
    if (
        role == "env"
    ):  # no model; env.name=code runs each program in a sandbox capped at env.sandbox.memory_mb
        mb = cfg.env.sandbox.memory_mb if cfg.env.sandboxed else 0
        return [Term("sandbox", mb * MIB, "env.sandbox.memory_mb")]
    runs = phases(cfg, command, shape) or [None]
    rl = [p for p in runs if p and p.name == "grpo"]
    if role == "rollout":
        return engine_terms(cfg, shape, rl[0] if rl else None)
    if role in ("ref", "reward"):
        return frozen_terms(cfg, shape, role, rl[0] if rl else runs[-1])
    per_phase = [trainer_terms(cfg, shape, p) for p in runs if p]
    return max(per_phase, key=lambda terms: sum(t.nbytes for t in terms), default=[])


def role_rank_bytes(cfg: RunConfig, role: str, gpu: bool, command: str = "train") -> int:
    """Host memory of one rank of `role` besides its process's runtime. On a GPU the model lives in GPU memory
    and the host stages one copy of the weights."""
    if gpu and role != "env":
        return model_shape(cfg).params * DTYPE_BYTES[cfg.model.dtype]
    return sum(t.nbytes for t in role_terms(cfg, role, command))


# ---------------------------------------------------------------------------------------------------------
# Nodes: what runs where, against what memory
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rank:
    """One rank (or process) of a role, its terms with the runtime's."""

    role: str
    rank: int
    terms: list[Term]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.terms)


@dataclass(frozen=True)
class Node:
    """A group of ranks that share one memory: this machine (local), or a pool's bundle (ray). `turns`: the model
    roles share one process and work in turn (the local loop), so the node holds every role's resident terms and
    the working terms of one role at a time, the largest; env workers are processes of their own."""

    name: str
    ranks: list[Rank]
    extra: int  # Ray's services on this node
    capacity: int | None  # bytes; None: not declared
    capacity_from: str
    turns: bool = False

    @property
    def nbytes(self) -> int:
        if not self.turns:
            return self.extra + sum(r.nbytes for r in self.ranks)
        return (
            self.extra
            + sum(r.nbytes for r in self.ranks if r.role == "env")
            + in_turn([r for r in self.ranks if r.role != "env"])
        )


def in_turn(ranks: list[Rank]) -> int:
    """Ranks of one process that work one at a time: every resident term and the largest working set."""
    resident = sum(t.nbytes for r in ranks for t in r.terms if not t.working)
    return resident + max((sum(t.nbytes for t in r.terms if t.working) for r in ranks), default=0)


def main_process_bytes(cfg: RunConfig, command: str) -> int:
    """A local run's main process (the driver and every model role; env workers are processes of their own): what
    its peak resident set should be."""
    if cfg.runtime.backend != "local":
        raise ValueError("main_process_bytes: runtime.backend=local runs every model role in one process")
    return in_turn([r for r in nodes(cfg, command)[0].ranks if r.role != "env"])


def machine_memory() -> int:
    """This machine's total RAM (/proc/meminfo MemTotal)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemTotal")


def _runtime(role: str, local: bool = True) -> Term:
    if role == "env" and local:  # a Ray env worker is an actor process like the others
        return Term("runtime", ENV_WORKER_BYTES, "fewer runtime.env_workers")
    return Term("runtime", RUNTIME_BYTES, "fewer processes (colocate roles on one pool)")


def _weights(cfg: RunConfig) -> Term:
    """A whole copy of the policy's weights in model.dtype."""
    return Term("params", model_shape(cfg).params * DTYPE_BYTES[cfg.model.dtype], "model.dtype=bfloat16")


def spare_terms(cfg: RunConfig) -> list[Term]:
    """A trainer rank's spare: a warm process (imports only) or, with trainer_standby, a built rank (its model)."""
    if not cfg.runtime.trainer_standby:
        return [Term("runtime", RUNTIME_BYTES, "runtime.trainer_warm=false")]
    return [Term("runtime", RUNTIME_BYTES, "runtime.trainer_standby=false"), _weights(cfg)]


def nodes(cfg: RunConfig, command: str) -> list[Node]:
    """Where the run's ranks live and the memory each place has."""
    rt = cfg.runtime
    roles = ["actor", "rollout", *wanted_roles(cfg, command)]  # every command evaluates: an engine and envs
    env = [Rank("env", i, [_runtime("env"), *role_terms(cfg, "env", command)]) for i in range(rt.env_workers)]
    if rt.backend == "local":  # one process holds every model role; env workers are processes of their own
        main = Rank("driver", 0, [_runtime("driver")])
        ranks = [main, *(Rank(r, 0, role_terms(cfg, r, command)) for r in roles), *env]
        return [Node("this machine", ranks, 0, machine_memory(), "/proc/meminfo MemTotal", turns=True)]
    placement = rt.pools()
    count = {"actor": rt.trainer_ranks, "rollout": rt.engines, "env": rt.env_workers}
    out: list[Node] = []
    devices: list[Node] = []  # GPU memory: one bundle's GPUs per GPU pool
    here = not rt.cluster.address
    # the driver keeps a whole copy of the policy (what a checkpoint's HF weights and a restart start from)
    driver = [Rank("driver", 0, [_runtime("driver"), _weights(cfg)])]
    placed = dict(placement.roles)
    for role in (r for r in roles if r not in placed and r != "reward"):
        placed[role] = placed.get("actor", "actor")  # critic and reference live beside the actor
    for pool in placement.pools:
        on = [r for r, p in placed.items() if p == pool.name and (r in roles or r == "env")]
        ranks = []
        gpu = pool.resources.get("GPU", 0) > 0
        for role in on:
            terms = [_runtime(role, local=False), *role_terms(cfg, role, command)]
            if (
                gpu and role != "env"
            ):  # the model lives in GPU memory; the host stages one copy of the weights
                terms = [_runtime(role, local=False), _weights(cfg)]
            ranks.extend(Rank(role, i, terms) for i in range(count.get(role, rt.trainer_ranks)))
            if role == "actor" and (rt.trainer_standby or rt.warm_processes()):
                ranks.extend(Rank("spare", i, spare_terms(cfg)) for i in range(rt.trainer_ranks))
        declared = pool.resources.get("memory")
        capacity = int(declared * pool.bundles) if declared else None
        out.append(Node(f"pool {pool.name} ({pool.bundles} bundles)", ranks, 0, capacity,
                        f"runtime.placement pool {pool.name}'s memory"))  # fmt: skip
        if gpu:
            devices.append(gpu_node(cfg, command, pool, [r for r in on if r != "env"]))
    if "reward" in roles and "reward" not in placement.roles:
        driver.append(Rank("reward", 0, role_terms(cfg, "reward", command)))
    out.insert(0, Node("driver", driver, RAY_HEAD_BYTES, None, ""))
    if here:  # a local Ray on this machine: every pool shares its memory
        every = [r for n in out for r in n.ranks]
        machine = Node(
            "this machine (local Ray)", every, RAY_HEAD_BYTES, machine_memory(), "/proc/meminfo MemTotal"
        )
        return [machine, *(n for n in out[1:] if n.capacity is not None), *devices]
    return out + devices


# a process's CUDA context and the caching allocator's first blocks (approximate)
CUDA_CONTEXT_BYTES = 512 * MIB


def gpu_node(cfg: RunConfig, command: str, pool: PoolConfig, roles: list[str]) -> Node:
    """The GPU memory of one bundle of a GPU pool: one rank of each model role placed on it (a rank per bundle),
    each its CUDA context and its terms (the same terms as on a CPU: weights, gradients, optimizer, activations,
    logits, KV cache). vLLM takes its rollout.vllm.memory_fraction of the GPUs whatever it holds."""
    gpus = pool.resources["GPU"]
    capacity = int(pool.gpu_memory_gib * gpus * GIB) if pool.gpu_memory_gib else None
    ranks = []
    for role in roles:
        terms = [t for t in role_terms(cfg, role, command) if t.name != "packed"]  # a CPU engine's only
        if role == "rollout" and cfg.rollout.engine == "vllm" and capacity:
            reserved = int(cfg.rollout.vllm.memory_fraction * capacity)
            params = next(t for t in terms if t.name == "params")
            terms = [
                params,
                Term("kv_cache", max(0, reserved - params.nbytes), "rollout.vllm.memory_fraction"),
            ]
        context = Term(
            "runtime", CUDA_CONTEXT_BYTES, "fewer processes on the GPU (colocate roles on one pool)"
        )
        ranks.append(Rank(role, 0, [context, *terms]))
    name = f"pool {pool.name}: GPU memory of one bundle ({gpus:g} GPU)"
    return Node(name, ranks, 0, capacity, f"runtime.placement pool {pool.name}'s gpu_memory_gib x {gpus:g}")


# ---------------------------------------------------------------------------------------------------------
# FLOPs, the report, the check
# ---------------------------------------------------------------------------------------------------------


def step_flops(cfg: RunConfig, command: str) -> list[tuple[str, float]]:
    """Per phase's step: (what, FLOPs): 6 x params x tokens to train, 2 x params x tokens to generate or score
    (an MoE model's active parameters: those of the experts a token goes through)."""
    shape = model_shape(cfg)
    n = shape.active_params
    out = []
    for p in phases(cfg, command, shape):
        tokens = p.step_rows * p.seq
        out.append((f"{p.name} train", 6.0 * n * tokens))
        if p.generated_rows:
            out.append((f"{p.name} generate", 2.0 * n * p.generated_rows * p.seq))
        if p.forwards:
            out.append((f"{p.name} log-probs", 2.0 * n * p.forwards * p.generated_rows * p.seq))
    return out


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def _mib(n: float) -> str:
    return f"{n / MIB:.0f}"


def report(cfg: RunConfig, command: str) -> list[str]:
    """The plan as lines of text."""
    shape = model_shape(cfg)
    mixed = cfg.training.mixed_precision
    moe = active = ""
    if shape.experts > 1:
        moe = f", {shape.experts} experts of which {shape.experts_per_token} per token"
        active = f", {shape.active_params / 1e6:.1f}M active per token"
    lines = [
        f"loopline plan: {command}, runtime.backend={cfg.runtime.backend}, model {shape.params / 1e6:.1f}M "
        f"parameters{active} (hidden {shape.hidden}, {shape.layers} layers{moe}, vocab {shape.vocab}), "
        f"{cfg.model.dtype}, "
        f"activation_checkpointing={activation_checkpointing(cfg)}"
        + (f", mixed_precision={mixed} (engines {cfg.engine_dtype})" if mixed == "bf16" else ""),
    ]
    for p in phases(cfg, command, shape):
        lines.append(f"  phase {p.name}: {p.micro_rows} rows x {p.seq} tokens a micro-batch per rank")
    names = ["runtime", "params", "optimizer", "grads", "update", "activations", "logits", "kv_cache", "packed",
             "sandbox"]  # fmt: skip
    if mixed == "bf16":  # the bf16 copy the trainer computes on
        names.insert(names.index("activations"), "compute_copy")
    for node in nodes(cfg, command):
        lines.append("")
        cap = f"{_gib(node.capacity)} GiB ({node.capacity_from})" if node.capacity else "not declared"
        lines.append(f"{node.name}: {_gib(node.nbytes)} GiB of {cap}")
        lines.append(f"  {'MiB':<8} {'rank':>4} " + " ".join(f"{n:>11}" for n in names) + f" {'total':>9}")
        for r in node.ranks:
            got = {t.name: t.nbytes for t in r.terms if t.nbytes}
            cells = " ".join(f"{_mib(got[n]) if n in got else '-':>11}" for n in names)
            lines.append(f"  {r.role:<8} {r.rank:>4} {cells} {_mib(r.nbytes):>9}")
        if node.extra:
            lines.append(f"  Ray services: {_mib(node.extra)} MiB")
        if node.turns:
            lines.append("  the model roles share one process and work in turn: the total counts each role's "
                         "params and optimizer and the largest role's working terms")  # fmt: skip
    lines.append("")
    lines.append("step FLOPs: " + ", ".join(f"{what} {f:.3g}" for what, f in step_flops(cfg, command)))
    return lines


def check(cfg: RunConfig, command: str) -> None:
    """UserError naming the largest term and the setting that shrinks it when a node's ranks exceed its memory."""
    for node in nodes(cfg, command):
        if node.capacity is None or node.nbytes <= node.capacity:
            continue
        role, term = max(((r, t) for r in node.ranks for t in r.terms), key=lambda rt: rt[1].nbytes)
        raise UserError(
            f"plan: {node.name} needs {_gib(node.nbytes)} GiB but has {_gib(node.capacity)} GiB "
            f"({node.capacity_from}); the largest term is {role.role}'s {term.name} ({_gib(term.nbytes)} GiB): "
            f"to shrink it, {term.shrink} (or --no-plan-check to start anyway)"
        )
