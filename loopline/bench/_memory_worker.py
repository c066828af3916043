"""The processes `loopline bench memory` measures, one job each: TRL's GRPOTrainer on the bench's model directory
and batch (`trl`), and one GRPO training step of fixed rows with fixed old log-probs (`trial`). Each prints one
JSON line last. Also the bench's reward function, which loopline's env workers import by name.

Run as `python -m loopline.bench._memory_worker trl|trial JSON`; the leading underscore keeps it out of the
`loopline bench` list.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

from loopline.bench._procstat import status_bytes


def reward(prompt: str, completion: str, **_: Any) -> float:
    """Half the samples score 1, by parity of the completion's length in characters: groups are mixed, so every
    step has advantages to train on (a random model's samples are never right)."""
    return float(len(completion) % 2)


def trl_run(job: dict[str, Any]) -> dict[str, Any]:
    """TRL's GRPOTrainer for job['steps'] steps on the model directory's shape (random weights drawn from seed 0),
    its tokenizer, the prompts, job['samples'] samples each, job['new_tokens'] new tokens; seconds per step."""
    import torch
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from loopline.models.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(job["model_dir"])
    tokenizer.padding_side = "left"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(job["model_dir"]), attn_implementation="sdpa"
    )
    seconds: list[float] = []

    class StepTimer(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            seconds.append(-time.perf_counter())

        def on_step_end(self, *_: Any, **__: Any) -> None:
            seconds[-1] += time.perf_counter()

    def rewards(completions: list[str], **_: Any) -> list[float]:
        return [reward("", c) for c in completions]

    rows = len(job["prompts"]) * job["samples"]
    args = GRPOConfig(
        output_dir=job["out_dir"], use_cpu=True, bf16=False, per_device_train_batch_size=rows,
        num_generations=job["samples"], max_completion_length=job["new_tokens"], max_steps=job["steps"],
        temperature=1.0, save_strategy="no", report_to=[], logging_steps=1, seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    data = Dataset.from_list([{"prompt": p} for p in job["prompts"]])
    trainer = GRPOTrainer(
        model=model, reward_funcs=[rewards], args=args, train_dataset=data, processing_class=tokenizer,
        callbacks=[StepTimer()],
    )  # fmt: skip
    trainer.train()
    return {"ok": True, "step_seconds": seconds, "gradient_checkpointing": args.gradient_checkpointing}


def trial(job: dict[str, Any]) -> dict[str, Any]:
    """One GRPO policy step (the run's config: job['overrides']) on job['rows'] rows of job['prompt_tokens'] +
    job['length'] random tokens with fixed old log-probs and advantages: no generation, no reference; the
    optimizer's state already allocated, as in a run's later steps. On job.get('device', 'cpu') (a GPU for
    scripts/gpu_plan_check.py)."""
    import torch

    from loopline.config import load_config
    from loopline.data.batches import RolloutBatch
    from loopline.models.load import load_policy
    from loopline.runtime.ranks import setup_process
    from loopline.training.optim import step_in_chunks
    from loopline.training.parallel import apply_activation_checkpointing
    from loopline.training.policy import PolicyTrainer, grpo_loss
    from loopline.training.precision import cast_in_forward

    cfg = load_config(None, job["overrides"])
    setup_process(cfg)  # one thread (the bench's threads=1) and the allocator, as a run's processes
    device = torch.device(job.get("device", "cpu"))
    model = load_policy(cfg.model, seed=0)[0].to(device)
    cast_in_forward(model, cfg.training.mixed_precision)  # bf16 compute on fp32 masters, as the local actor
    mode = cfg.training.activation_checkpointing
    apply_activation_checkpointing(model, mode)
    trainer = PolicyTrainer(
        model, cfg.grpo.optim, 1, None, grpo_loss(cfg.grpo), cfg.grpo.micro_batch_size, cfg.model.packing,
        cfg.model.share_prompts, cfg.model.logits_chunk_tokens,
    )  # fmt: skip
    rows, length = job["rows"], job["length"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 500, (rows, job["prompt_tokens"] + length), generator=g)  # (B, P + C)
    vocab = model.config.vocab_size
    batch = RolloutBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        response_mask=torch.ones(rows, length),  # (B, C)
        old_logprobs=torch.full((rows, length), -math.log(vocab)),  # a uniform sampler's: fixed, no forward
        ref_logprobs=None,
        advantages=torch.tensor([1.0, -1.0] * (rows // 2) + [1.0] * (rows % 2)),  # (B,)
        rewards=torch.zeros(rows),
    ).to(device)
    # AdamW's moments exist, as they do through every step of a run but its first: a zero gradient's update
    # allocates them (moving nothing without weight decay, the bench's); without it a trial misses 8 bytes a parameter
    for param in (p for p in model.parameters() if p.requires_grad):
        param.grad = torch.zeros_like(param)
    # as a run steps: a warm-up with foreach's whole temporaries would set the peak
    step_in_chunks(trainer.optimizer)
    trainer.optimizer.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    stats = trainer.policy_step(batch, kl_coef=0.0)
    return {"ok": math.isfinite(stats.loss), "seconds": time.perf_counter() - t0}


def main(argv: list[str]) -> int:
    kind, job = argv[0], json.loads(argv[1])
    try:
        out = {"trl": trl_run, "trial": trial}[kind](job)
    except (MemoryError, RuntimeError) as e:  # an allocation over the limit: this trial fails, alone
        out = {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    out |= {"peak_rss": status_bytes("VmHWM"), "vm_peak": status_bytes("VmPeak")}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    status = main(sys.argv[1:])
    sys.stderr.flush()
    # no interpreter teardown: TRL's and datasets' threads can hold a finished process for minutes
    os._exit(status)
