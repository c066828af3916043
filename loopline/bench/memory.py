"""`loopline bench memory`: peak memory and step time of GRPO at a real shape, loopline against TRL, and the
longest completion a training step fits with the memory switches off and on.

One model directory (a preset's config.json and the BPE tokenizer padded to its vocabulary, random weights) is
written to a temp dir and used by every part:
- runs: `loopline train` (GRPO only, --prompts x --samples rows, prompts of --prompt-tokens tokens, --new-tokens
  new tokens, one torch thread, the memory switches on) on the local backend and on Ray with 2 FSDP2 ranks, and
  TRL's GRPOTrainer (its defaults: gradient checkpointing on) on the same directory, batch and lengths. Each runs
  in a process tree of its own; its peak resident set is the largest sum of VmRSS over the tree's processes,
  sampled from /proc every 0.2 s (short spikes between samples are missed). `loopline plan`'s estimate for the
  same config is printed beside each loopline peak.
- lengths: one GRPO training step of --rows rows with fixed old log-probs (no generation, no reference; AdamW's
  moments allocated first, as in a run's later steps), the completion doubling over --lengths until a step
  fails or the plan refuses it, memory switches off, then on.
  Each trial is a process of its own under RLIMIT_AS = --limit-gib, so that a trial that does not fit fails
  alone with an allocation error (never the machine's OOM killer). RLIMIT_AS counts virtual memory, which torch
  and its libraries reserve beyond what they touch: each trial's peak RSS and VmPeak are printed to show the gap.
Prints `name: value` lines, ending with memory_ratio_vs_trl (loopline local's peak / TRL's).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from loopline.bench.args import require_positive

GIB = 2**30
# The memory switches `on` sets; off is every one at its default. `--mixed-precision` adds a ladder with bf16
# compute on fp32 master weights as well: opt-in, since a CPU without native bf16 runs it many times slower.
MEMORY_SWITCHES = ["training.activation_checkpointing=full", "model.logits_chunk_tokens=512"]
MIXED_PRECISION = "training.mixed_precision=bf16"
# --auto: the runs with loopline's defaults, the switches and the precision chosen on this machine (plan_auto)
AUTO = ["training.memory=auto", "training.mixed_precision=auto"]
# --quick: the Qwen2 architecture at a toy size (a vocabulary the BPE tokenizer fits), for tests
TINY = {
    "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}  # fmt: skip
WORKER = "loopline.bench._memory_worker"


# ---------------------------------------------------------------------------------------------------------
# Measuring a process tree
# ---------------------------------------------------------------------------------------------------------


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, from /proc."""
    kids: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def _rss(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError):
        return 0


class TreePeak:
    """The largest summed resident set of a process and its descendants, sampled every `every` seconds."""

    def __init__(self, pid: int, every: float = 0.2) -> None:
        self.pid, self.every = pid, every
        self.peak = 0
        self.largest = 0  # the largest single process seen
        self.processes = 0  # processes in the tree at the peak
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            kids, tree, i = _children(), [self.pid], 0
            while i < len(tree):
                tree.extend(kids.get(tree[i], []))
                i += 1
            sizes = [_rss(p) for p in tree]
            if sum(sizes) > self.peak:
                self.peak, self.processes = sum(sizes), sum(1 for s in sizes if s)
            self.largest = max(self.largest, *sizes)
            self._stop.wait(self.every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _limit_as(nbytes: int) -> Any:
    """A preexec_fn capping the child's virtual memory (RLIMIT_AS): an allocation past it fails in that process."""

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (nbytes, nbytes))

    return apply


def measured(cmd: list[str], log: Path, limit: int | None = None) -> tuple[int, TreePeak, float]:
    """Run `cmd` (output to `log`) while sampling its tree: (exit status, its peaks, wall seconds)."""
    t0 = time.perf_counter()
    with open(log, "w") as out:
        env = os.environ | {"OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=_limit_as(limit) if limit else None)  # fmt: skip
        peak = TreePeak(proc.pid)
        status = proc.wait()
        peak.stop()
    return status, peak, time.perf_counter() - t0


def _last_json(log: Path) -> dict[str, Any]:
    lines = [line for line in log.read_text().splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {"ok": False, "error": log.read_text()[-300:]}


# ---------------------------------------------------------------------------------------------------------
# The model directory, the prompts, the configs
# ---------------------------------------------------------------------------------------------------------


def write_model_dir(where: Path, fields: dict[str, Any]) -> Any:
    """A model directory holding `fields` as config.json and the BPE tokenizer padded to its vocabulary (no
    weights: loopline builds it with model.init=random, TRL from the config); the tokenizer."""
    from transformers import AutoConfig

    from loopline.models.tokenizer import bpe_tokenizer

    fields = dict(fields)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    tokenizer = bpe_tokenizer(config.vocab_size)
    config.pad_token_id, config.bos_token_id = tokenizer.pad_token_id, tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.save_pretrained(where)
    tokenizer.save_pretrained(where)
    return tokenizer


def prompts_of(tokenizer: Any, count: int, tokens: int) -> list[str]:
    """`count` different prompts of addition problems that encode to exactly `tokens` tokens each."""
    out = []
    for i in range(count):
        text = "".join(f"{(i * 7919 + j * 104729) % 997}+{(j * 31 + i) % 991}=\n" for j in range(tokens))
        n = len(text)
        while len(tokenizer(text[:n])["input_ids"]) > tokens:
            n -= 1
        if len(tokenizer(text[:n])["input_ids"]) != tokens:
            raise RuntimeError(f"no prompt of exactly {tokens} tokens")
        out.append(text[:n])
    return out


def run_overrides(a: argparse.Namespace, model_dir: Path, data: Path, new_tokens: int, rows: tuple[int, int],
                  switches: list[str]) -> list[str]:  # fmt: skip
    """`loopline train`'s GRPO-only config for the bench, with `switches` (overrides) added: rows = (prompts,
    samples per prompt)."""
    prompts, samples = rows
    base = [
        f"model.path={model_dir}", "model.init=random", "data.source=jsonl", f"data.train_path={data}",
        f"data.max_prompt_tokens={a.prompt_tokens}", "sft.steps=0", f"grpo.steps={a.steps}",
        f"grpo.prompts_per_step={prompts}", f"grpo.group_size={samples}", f"grpo.micro_batch_size={prompts * samples}",
        f"grpo.sampling.max_new_tokens={new_tokens}", "grpo.sampling.stop=[]", "grpo.kl_coef=0", "grpo.eval_every=0",
        "grpo.stop_at_accuracy=null", "checkpoint_every=0", "threads=1", "progress=false", "tensorboard=false",
        f"env.name=python:{WORKER}:reward",
        # the switches as the bench sets them, not as auto would choose them on this machine
        "training.memory=manual", "training.mixed_precision=none",
    ]  # fmt: skip
    return base + switches


def plan_bytes(overrides: list[str], actor_only: bool = False) -> int:
    """`loopline plan`'s estimate: the first node's total (the whole run), or one actor rank with its process."""
    from loopline import plan
    from loopline.config import load_config
    from loopline.plan_auto import resolve

    cfg = resolve(load_config(None, overrides), "train").cfg  # as the run resolves its auto settings
    if actor_only:
        return plan.RUNTIME_BYTES + sum(t.nbytes for t in plan.role_terms(cfg, "actor", "train"))
    return plan.nodes(cfg, "train")[0].nbytes


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


# ---------------------------------------------------------------------------------------------------------
# The parts
# ---------------------------------------------------------------------------------------------------------


def run_loopline(
    a: argparse.Namespace, tmp: Path, model_dir: Path, data: Path, backend: str
) -> tuple[int, float]:
    """One `loopline train` run: its tree's peak beside the plan's estimate, and its step time; (0, 0) if it failed."""
    out = tmp / f"run-{backend}"
    switches = AUTO if a.auto else MEMORY_SWITCHES
    overrides = run_overrides(a, model_dir, data, a.new_tokens, (a.prompts, a.samples), switches)
    if backend == "ray":
        overrides += ["runtime.backend=ray", "runtime.trainer_ranks=2"]
    overrides.append(f"out_dir={out}")
    cmd = [sys.executable, "-m", "loopline.cli", "train", *overrides]
    # RLIMIT_AS on the local run's processes only: Ray's services reserve far more virtual memory than they touch
    limit = int(a.run_limit_gib * GIB) if a.run_limit_gib and backend == "local" else None
    status, peak, wall = measured(cmd, tmp / f"{backend}.log", limit)
    if status:
        print(f"{backend}_error: exit {status}: {(tmp / f'{backend}.log').read_text()[-400:]!r}")
        return 0, 0.0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["time_step"] for r in rows if r.get("phase") == "grpo" and "time_step" in r]
    step = sum(steps[1:]) / len(steps[1:]) if len(steps) > 1 else steps[0]  # the first is a warm-up
    print(f"{backend}_peak_rss_gib: {_gib(peak.peak)}  (plan {_gib(plan_bytes(overrides))}; summed over "
          f"{peak.processes} processes, largest {_gib(peak.largest)})")  # fmt: skip
    print(f"{backend}_step_s: {step:.2f}  (wall {wall:.0f} s with start-up)")
    return peak.peak, step


def run_trl(a: argparse.Namespace, tmp: Path, model_dir: Path, prompts: list[str]) -> tuple[int, float]:
    """TRL's GRPOTrainer on the same directory, batch and lengths: (peak, step seconds)."""
    job = {"model_dir": str(model_dir), "prompts": prompts, "samples": a.samples, "new_tokens": a.new_tokens,
           "steps": a.steps, "out_dir": str(tmp / "trl")}  # fmt: skip
    limit = int(a.run_limit_gib * GIB) if a.run_limit_gib else None
    status, peak, wall = measured(
        [sys.executable, "-m", WORKER, "trl", json.dumps(job)], tmp / "trl.log", limit
    )
    result = _last_json(tmp / "trl.log")
    if status or not result.get("ok"):
        print(f"trl_error: exit {status}: {result.get('error', (tmp / 'trl.log').read_text()[-400:])!r}")
        return 0, 0.0
    steps = result["step_seconds"]
    step = sum(steps[1:]) / len(steps[1:]) if len(steps) > 1 else steps[0]
    print(f"trl_peak_rss_gib: {_gib(peak.peak)}  (plan -: it plans loopline's runs; summed over "
          f"{peak.processes} processes, gradient_checkpointing={result['gradient_checkpointing']})")  # fmt: skip
    print(f"trl_step_s: {step:.2f}  (wall {wall:.0f} s with start-up)")
    return peak.peak, step


def length_ladder(
    a: argparse.Namespace, tmp: Path, model_dir: Path, data: Path, name: str, switches: list[str]
) -> int:
    """The longest completion (of --lengths, doubling) whose training step succeeds under the limit with
    `switches` (the ladder `name`: off, on, mixed); 0: none."""
    best, limit = 0, int(a.limit_gib * GIB)
    for length in a.lengths:
        overrides = run_overrides(a, model_dir, data, length, (1, a.rows), switches)
        estimate = plan_bytes(overrides, actor_only=True)
        if estimate > limit:
            print(
                f"trial_{name}_{length}: refused by the plan ({_gib(estimate)} GiB > limit {a.limit_gib:g})"
            )
            break
        job = {"overrides": overrides, "rows": a.rows, "length": length, "prompt_tokens": a.prompt_tokens}
        log = tmp / f"trial-{name}-{length}.log"
        status, peak, _ = measured([sys.executable, "-m", WORKER, "trial", json.dumps(job)], log, limit)
        result = _last_json(log)
        if status or not result.get("ok"):
            why = result.get("error") or f"exit {status}"
            print(f"trial_{name}_{length}: failed ({why}; plan {_gib(estimate)} GiB)")
            break
        print(f"trial_{name}_{length}: ok {result['seconds']:.1f} s, peak_rss {_gib(result['peak_rss'])} GiB "
              f"(plan {_gib(estimate)}), vm_peak {_gib(result['vm_peak'])} GiB")  # fmt: skip
        best = length
    print(f"length_limit_{name}: {best}  ({a.rows} rows + {a.prompt_tokens} prompt tokens, RLIMIT_AS "
          f"{a.limit_gib:g} GiB, switches {' '.join(switches) or 'off'})")  # fmt: skip
    return best


def _lengths(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma list of integers (got {text!r})") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"lengths must be at least 1 (got {text!r})")
    return values


def main(argv: list[str]) -> int:
    from loopline.models.presets import PRESETS

    parser = argparse.ArgumentParser(prog="loopline bench memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--preset", default="qwen2.5-0.5b", choices=sorted(PRESETS), help="the model's shape")
    parser.add_argument("--quick", action="store_true", help="a toy Qwen2 shape and short lengths (tests)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="tokens of each prompt")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per sample")
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps per run (the first is a warm-up)")
    parser.add_argument("--backends", default="local,ray", help="loopline runs: local, ray (2 FSDP2 ranks)")
    parser.add_argument("--no-trl", action="store_true", help="skip TRL (and the headline ratio)")
    parser.add_argument("--rows", type=int, default=16, help="rows of a length trial's training step")
    parser.add_argument("--lengths", type=_lengths, default=[256, 512, 1024, 2048, 4096, 8192],
                        help="completion lengths tried, in order, until one fails (empty with --no-lengths)")  # fmt: skip
    parser.add_argument("--no-lengths", action="store_true", help="skip the length trials")
    parser.add_argument("--mixed-precision", action="store_true",
                        help=f"a third ladder: the switches and {MIXED_PRECISION} (slow on a CPU without bf16)")  # fmt: skip
    parser.add_argument("--auto", action="store_true",
                        help="the runs with the defaults (training.memory and mixed_precision auto), not the switches")  # fmt: skip
    parser.add_argument("--limit-gib", type=float, default=12.0, help="RLIMIT_AS of each length trial")
    parser.add_argument("--run-limit-gib", type=float, default=0.0,
                        help="RLIMIT_AS of each process of the local and TRL runs (0: none)")  # fmt: skip
    args = parser.parse_args(argv)
    require_positive(
        parser, args, "prompts", "samples", "prompt_tokens", "new_tokens", "steps", "rows", "limit_gib"
    )
    backends = args.backends.split(",") if args.backends else []
    if set(backends) - {"local", "ray"}:
        parser.error(f"--backends must be a comma list of local, ray (got {args.backends!r})")
    fields = TINY if args.quick else PRESETS[args.preset]

    with tempfile.TemporaryDirectory(prefix="loopline-bench-memory-") as name:
        tmp = Path(name)
        model_dir = tmp / "model"
        tokenizer = write_model_dir(model_dir, fields)
        prompts = prompts_of(tokenizer, args.prompts, args.prompt_tokens)
        data = tmp / "prompts.jsonl"
        data.write_text("".join(json.dumps({"prompt": p, "answer": "0"}) + "\n" for p in prompts))
        print(f"model: {'tiny (--quick)' if args.quick else args.preset}, random init, {model_dir.name} dir")
        print(f"batch: {args.prompts} prompts x {args.samples} samples, {args.prompt_tokens} prompt tokens, "
              f"{args.new_tokens} new tokens, {args.steps} steps, 1 torch thread per process")  # fmt: skip
        print(f"load_average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        peaks = {b: run_loopline(args, tmp, model_dir, data, b) for b in backends}
        trl_peak, trl_step = (0, 0.0) if args.no_trl else run_trl(args, tmp, model_dir, prompts)
        if not args.no_lengths:
            off = length_ladder(args, tmp, model_dir, data, "off", [])
            on = length_ladder(args, tmp, model_dir, data, "on", MEMORY_SWITCHES)
            print(f"length_ratio_on_over_off: {on / off:.2f}" if off else "length_ratio_on_over_off: n/a")
            if args.mixed_precision:
                mixed = length_ladder(
                    args, tmp, model_dir, data, "mixed", [*MEMORY_SWITCHES, MIXED_PRECISION]
                )
                print(
                    f"length_ratio_mixed_over_off: {mixed / off:.2f}"
                    if off
                    else "length_ratio_mixed_over_off: n/a"
                )
    local_peak, local_step = peaks.get("local", (0, 0.0))
    if trl_peak and local_peak:
        print(f"step_time_ratio_vs_trl: {local_step / trl_step:.2f}")
        print(f"memory_ratio_vs_trl: {local_peak / trl_peak:.2f}")
    return 0
