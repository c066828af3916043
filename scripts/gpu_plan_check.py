"""What `loopline plan` puts in a GPU bundle for a trainer rank, measured on a GPU (CI has none: run by hand).

Prints the CUDA context this process holds once initialised (free memory before any tensor), then, per case,
`loopline bench memory`'s trial on the GPU (one GRPO policy step of a preset's shape with random weights, the
optimizer's moments allocated first, as in a run's later steps): the allocator's peak, its reserved peak, and
the plan's actor terms for the same config (`plan.gpu_node`'s: the context plus every term but the CPU engine's
packed copy). Usage: python scripts/gpu_plan_check.py [PRESET:ROWS:LENGTH[:on|off][:bf16] ...] (on: the memory
switches; bf16: training.mixed_precision=bf16)
"""

from __future__ import annotations

import sys

import torch

GIB = 2**30
CASES = ["qwen2.5-0.5b:8:512:off", "qwen2.5-0.5b:8:512:on", "qwen2.5-1.5b:8:512:on"]
SWITCHES = ["training.activation_checkpointing=full", "model.logits_chunk_tokens=512"]
PROMPT_TOKENS = 64


def overrides(preset: str, rows: int, length: int, switches: bool, bf16: bool) -> list[str]:
    return [
        "model.init=random", f"model.preset={preset}", "sft.steps=0", "grpo.prompts_per_step=1",
        f"grpo.group_size={rows}", f"grpo.micro_batch_size={rows}", f"grpo.sampling.max_new_tokens={length}",
        f"data.max_prompt_tokens={PROMPT_TOKENS}", "grpo.kl_coef=0", "threads=4",
        *(SWITCHES if switches else []), *(["training.mixed_precision=bf16"] if bf16 else []),
    ]  # fmt: skip


def step_peak(over: list[str], rows: int, length: int) -> dict[str, float]:
    """`loopline bench memory`'s trial (one GRPO policy step) on the GPU: seconds, allocated and reserved peaks."""
    from loopline.bench._memory_worker import trial

    torch.cuda.reset_peak_memory_stats()
    job = {
        "overrides": over,
        "rows": rows,
        "length": length,
        "prompt_tokens": PROMPT_TOKENS,
        "device": "cuda",
    }
    out = trial(job)
    torch.cuda.synchronize()
    return {
        "seconds": out["seconds"],
        "loss_finite": float(out["ok"]),
        "peak": torch.cuda.max_memory_allocated(),
        "reserved": torch.cuda.max_memory_reserved(),
    }


def main(argv: list[str]) -> int:
    from loopline import plan
    from loopline.config import load_config

    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    context = total - free  # nothing allocated yet: this process's context (a bare GPU holds no other)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"cuda_context_gib: {context / GIB:.3f}  (plan {plan.CUDA_CONTEXT_BYTES / GIB:.3f})")
    for case in argv or CASES:
        preset, rows, length, *rest = case.split(":")
        switches, bf16 = "off" not in rest, "bf16" in rest
        over = overrides(preset, int(rows), int(length), switches, bf16)
        cfg = load_config(None, over)
        terms = [t for t in plan.role_terms(cfg, "actor", "train") if t.name != "packed"]
        planned = plan.CUDA_CONTEXT_BYTES + sum(t.nbytes for t in terms)
        got = step_peak(over, int(rows), int(length))
        measured = context + got["reserved"]
        name = f"{preset}_{rows}x{length}_{'on' if switches else 'off'}{'_bf16' if bf16 else ''}"
        print(f"{name}_terms: " + ", ".join(f"{t.name} {t.nbytes / GIB:.2f}" for t in terms))
        print(f"{name}_step_s: {got['seconds']:.2f}  (loss finite: {bool(got['loss_finite'])})")
        print(f"{name}_allocated_peak_gib: {got['peak'] / GIB:.2f}")
        print(f"{name}_measured_gib: {measured / GIB:.2f}  (context + reserved peak)")
        print(f"{name}_plan_gib: {planned / GIB:.2f}")
        print(f"{name}_plan_over_measured: {planned / measured:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
