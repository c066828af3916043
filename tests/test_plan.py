"""`loopline plan`: the memory of each role's rank and the step's FLOPs from the config alone; a config that cannot
fit exits 2 naming the largest term and the setting that shrinks it, and train/sft/dpo/rm make the same check
before anything is written. The estimate is checked against the peak resident set of real local runs."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loopline.config import load_config
from loopline.plan import (
    GIB,
    LOGITS_COPIES,
    RUNTIME_BYTES,
    activation_bytes,
    eval_prompts,
    logits_bytes,
    main_process_bytes,
    model_shape,
    nodes,
    phases,
    role_terms,
    step_flops,
)
from loopline.training.config import STEP_CHUNK_BYTES

ROOT = Path(__file__).resolve().parents[1]
# a 6B-parameter shape of the built-in model: fp32 weights, grads and AdamW alone are ~90 GiB
HUGE = [
    "model.tiny.hidden_size=4096", "model.tiny.num_layers=32", "model.tiny.intermediate_size=12000",
    "model.tiny.num_heads=32", "model.tiny.num_kv_heads=8",
]  # fmt: skip


def _cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "loopline.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=120,
    )


def _terms(cfg, role: str = "actor", command: str = "train") -> dict[str, int]:
    return {t.name: t.nbytes for t in role_terms(cfg, role, command)}


def _logits(cfg) -> int:
    """The trainer's logits term for its GRPO phase's micro-batch."""
    (grpo,) = phases(cfg, "train", model_shape(cfg))
    return logits_bytes(cfg, grpo.micro_rows, grpo.seq, grpo.response, LOGITS_COPIES, model_shape(cfg).vocab)


def test_the_terms_follow_their_formulas():
    cfg = load_config(None, ["grpo.micro_batch_size=16", "sft.steps=0"])
    shape, (grpo,) = model_shape(cfg), phases(cfg, "train", model_shape(cfg))
    t = _terms(cfg)
    assert t["params"] == shape.params * 4  # fp32, one rank
    assert t["optimizer"] == shape.params * 4 * 2  # AdamW's two fp32 moments
    # fp32 logits over every position, then log-softmax, its gradient and the slice's over the completion's 8
    assert _logits(cfg) == 16 * (grpo.seq + 3 * 8) * 259 * 4
    rows, seq = 64 * 8, grpo.seq  # the engine runs the step's rows (or eval's 1000 prompts) at once
    kv = _terms(cfg, "rollout")["kv_cache"]
    assert (
        kv == max(rows, 1000) * seq * 4 * 2 * 2 * 32 * 4
    )  # rows x tokens x layers x (k, v) x kv heads x head dim
    flops = dict(step_flops(cfg, "train"))
    assert flops["grpo train"] == 6.0 * shape.params * rows * seq
    assert flops["grpo generate"] == 2.0 * shape.params * rows * seq


def test_log_prob_forwards_are_counted_where_the_loop_runs_them():
    """One update per batch takes its old log-probs from the training forward itself: no forward of its own.
    More updates per batch, a reference, or a behaviour correction each cost one more forward."""

    def forwards(*overrides: str) -> float:
        cfg = load_config(None, ["sft.steps=0", "grpo.kl_coef=0", *overrides])
        return (
            dict(step_flops(cfg, "train")).get("grpo log-probs", 0.0)
            / dict(step_flops(cfg, "train"))["grpo generate"]
        )

    assert forwards() == 0
    assert forwards("grpo.epochs_per_step=2") == forwards("grpo.kl_coef=0.1") == 1
    assert forwards("grpo.behaviour_correction=tis") == 1
    assert forwards("grpo.kl_coef=0.1", "grpo.minibatches=2", "grpo.micro_batch_size=32") == 2


@pytest.mark.parametrize("backend", ["local", "ray"])
def test_an_engine_copy_and_the_ray_driver_s_policy_are_counted_where_they_exist(backend):
    """A local engine on the actor's parameters (rollout.share_weights) holds no weights; with LoRA it needs a
    copy (merged adapters). On ray the engine is a process of its own, and the driver keeps a whole policy."""
    from loopline.plan import nodes

    base = ["sft.steps=0", f"runtime.backend={backend}"]
    weights = model_shape(load_config(None, base)).params * 4
    assert _terms(load_config(None, base), "rollout")["params"] == (0 if backend == "local" else weights)
    if backend == "local":
        assert _terms(load_config(None, [*base, "model.lora.r=4"]), "rollout")["params"] == weights
    driver = {t.name: t.nbytes for t in nodes(load_config(None, base), "train")[0].ranks[0].terms}
    assert driver.get("params", 0) == (weights if backend == "ray" else 0)


@pytest.mark.parametrize(
    "extra,spare",
    [
        ([], None),  # no restarts: no spares
        (["runtime.max_restarts=1"], {"runtime"}),  # warm processes (runtime.trainer_warm's default there)
        (["runtime.max_restarts=1", "runtime.trainer_warm=false"], None),
        (["runtime.max_restarts=1", "runtime.trainer_standby=true"], {"runtime", "params"}),  # built ranks
    ],
)
def test_a_trainer_rank_s_spare_is_planned_where_the_run_starts_one(extra, spare):
    from loopline.plan import RUNTIME_BYTES, nodes

    cfg = load_config(None, ["runtime.backend=ray", "runtime.trainer_ranks=2", *extra])
    spares = [r for n in nodes(cfg, "train")[:1] for r in n.ranks if r.role == "spare"]
    if spare is None:
        assert spares == []
        return
    assert [r.rank for r in spares] == [0, 1]
    terms = {t.name: t.nbytes for t in spares[0].terms}
    assert set(terms) == spare and terms["runtime"] == RUNTIME_BYTES
    if "params" in terms:
        assert terms["params"] == model_shape(cfg).params * 4  # a whole float32 copy


def test_chunked_logits_hold_one_chunk_of_every_row_s_tokens():
    """model.logits_chunk_tokens: the chunks run over the completion tokens of all rows flattened, so the term is
    one chunk (and its three copies), not a chunk per row; a chunk longer than the micro-batch's tokens is them."""
    base = ["grpo.micro_batch_size=16", "sft.steps=0", "model.logits_chunk_tokens=64"]
    assert _logits(load_config(None, base)) == 64 * 4 * 259 * 4
    assert _logits(load_config(None, [*base, "grpo.micro_batch_size=8"])) == 64 * 4 * 259 * 4  # 64 of 64
    assert _logits(load_config(None, [*base, "grpo.micro_batch_size=4"])) == 4 * 8 * 4 * 259 * 4
    ref = load_config(None, [*base, "grpo.kl_coef=0.1"])
    assert _terms(ref, "ref")["logits"] == 64 * 2 * 259 * 4  # a frozen forward: logits and log-softmax


def test_an_engine_plans_the_held_out_prompts_it_can_be_given():
    """The engine's rows: the step's, or the held-out prompts scored at once, at most the split's size; a file
    source without data.eval_path scores none."""
    cfg = load_config(None, ["data.task.num_eval=100"])
    assert eval_prompts(cfg) == 100  # eval.batch_size 1000, num_prompts 2000, but 100 exist
    assert eval_prompts(load_config(None, ["eval.num_prompts=50"])) == 50
    assert eval_prompts(load_config(None, [])) == 1000  # the batch size
    files = ["data.source=jsonl", "data.train_path=x.jsonl"]
    assert eval_prompts(load_config(None, files)) == 0
    assert eval_prompts(load_config(None, [*files, "data.eval_path=y.jsonl"])) == 1000
    kv = {
        n: _terms(load_config(None, [*files, *more]), "rollout")["kv_cache"]
        for n, more in [("none", []), ("8", ["data.eval_path=y.jsonl", "eval.batch_size=8"]),
                        ("1000", ["data.eval_path=y.jsonl"])]
    }  # fmt: skip
    assert kv["none"] == kv["8"] < kv["1000"]  # the step's 512 rows; 1,000 held-out prompts at once


@pytest.mark.parametrize("binds", ["backward", "update"])
def test_a_trainer_is_planned_at_the_larger_of_its_backward_and_its_update(binds):
    """Backward's start holds the kept activations, the head's gradient and the larger of the logits and one
    layer's backward; its end and the update every gradient and the larger of the tied embedding's before it is
    summed into the head's and AdamW's temporaries for one chunk (the embedding alone here), the activations gone.
    A rank is planned at the larger; its params and optimizer are held at both."""
    rows = {"backward": ["grpo.micro_batch_size=64"], "update": ["grpo.micro_batch_size=1"]}[binds]
    cfg = load_config(None, ["sft.steps=0", "training.activation_checkpointing=full", *rows])
    shape, (grpo,) = model_shape(cfg), phases(cfg, "train", model_shape(cfg))
    kept, layer = activation_bytes(cfg, shape, grpo.micro_rows, grpo.seq)
    head = shape.vocab * shape.hidden * 4
    backward = kept + head + max(_logits(cfg), layer)
    chunk = min(shape.params * 4, max(STEP_CHUNK_BYTES, head))  # the tiny model: the whole model is one chunk
    update = shape.params * 4 + max(head, chunk)  # the gradients, then the larger temporary
    terms = role_terms(cfg, "actor", "train")
    working = {t.name: t.nbytes for t in terms if t.working}
    assert sum(working.values()) == max(backward, update)
    assert (backward > update) == (binds == "backward")
    if binds == "backward":
        assert working["grads"] == head and working["update"] == 0 and working["activations"] >= kept
    else:
        assert working["grads"] == shape.params * 4 and working["update"] == max(head, chunk)
        assert working["activations"] == working["logits"] == 0
    resident = {t.name: t.nbytes for t in terms if not t.working}
    assert resident == {"params": shape.params * 4, "optimizer": shape.params * 8}


def test_local_roles_working_in_turn_hold_one_working_set_at_a_time():
    """One process runs the local engine, the reference and the actor one after another: it holds all their
    resident terms and the largest working set, not every working set at once; env workers are processes."""
    cfg = load_config(None, ["grpo.kl_coef=0.1", "runtime.env_workers=2"])
    (node,) = nodes(cfg, "train")
    ranks = {r.role: r for r in node.ranks if r.role != "env"}
    assert set(ranks) == {"driver", "actor", "rollout", "ref"}
    resident = sum(t.nbytes for r in ranks.values() for t in r.terms if not t.working)
    working = [sum(t.nbytes for t in r.terms if t.working) for r in ranks.values()]
    assert working.count(0) == 1 and sorted(working)[-2] > 0  # the driver works in none; two or more do
    assert main_process_bytes(cfg, "train") == resident + max(working)
    assert main_process_bytes(cfg, "train") < sum(r.nbytes for r in ranks.values())
    envs = [r for r in node.ranks if r.role == "env"]
    assert len(envs) == 2 and node.nbytes == main_process_bytes(cfg, "train") + sum(r.nbytes for r in envs)
    assert ranks["driver"].nbytes == RUNTIME_BYTES


def test_a_cpu_engine_packing_its_weights_plans_their_copy():
    """rollout.pack_weights: a call of 16 or more new tokens decodes on a copy of the linear weights (float32).
    auto packs only in a local engine on the actor's own weights (the actor's freed gradients make room), always
    in any float32 CPU torch engine; shorter calls and bf16 engines never do."""
    long = ["grpo.sampling.max_new_tokens=16", "eval.sampling.max_new_tokens=16"]
    shape = model_shape(load_config(None, long))

    def packed(*overrides: str) -> int:
        return _terms(load_config(None, [*long, *overrides]), "rollout")["packed"]

    assert packed() == shape.params * 4  # a tied head: every weight
    assert packed("runtime.backend=ray", "rollout.pack_weights=always") == shape.params * 4
    for off in (["rollout.pack_weights=never"], ["rollout.dtype=bfloat16", "rollout.pack_weights=always"],
                ["runtime.backend=ray"], ["model.lora.r=4"], ["rollout.share_weights=false"]):  # fmt: skip
        assert packed(*off) == 0, off
    assert _terms(load_config(None, []), "rollout")["packed"] == 0  # 8 new tokens: no call packs


def test_checkpointing_and_sharding_shrink_their_terms():
    base = ["model.tiny.num_layers=8"]
    none = _terms(load_config(None, base))["activations"]
    selective = _terms(load_config(None, [*base, "training.activation_checkpointing=selective"]))[
        "activations"
    ]
    full = _terms(load_config(None, [*base, "training.activation_checkpointing=full"]))["activations"]
    assert full < selective < none
    # 8 layers' activations and backward's one -> their inputs, one layer recomputed and backward's one
    assert full < none / 3
    one = _terms(load_config(None, ["runtime.backend=ray"]))
    four = _terms(load_config(None, ["runtime.backend=ray", "runtime.trainer_ranks=4"]))
    for name in ("params", "grads", "optimizer"):
        assert four[name] == one[name] // 4
    lora = _terms(load_config(None, ["model.lora.r=4"]))
    assert lora["optimizer"] < one["optimizer"] / 10 and lora["params"] == one["params"]


def test_a_token_budget_sets_the_micro_batch_of_the_activations():
    # grpo rows are 17 tokens (9 of prompt, 8 new): a budget of 170 holds 10 of them, whatever micro_batch_size says
    cfg = load_config(
        None, ["sft.steps=0", "grpo.max_tokens_per_micro_batch=170", "grpo.micro_batch_size=64"]
    )
    (grpo,) = phases(cfg, "train", model_shape(cfg))
    assert (grpo.micro_rows, grpo.seq) == (10, 17)
    fixed = load_config(None, ["sft.steps=0", "grpo.micro_batch_size=10"])
    assert _terms(cfg)["activations"] == _terms(fixed)["activations"]
    assert _terms(cfg)["activations"] < _terms(load_config(None, ["sft.steps=0"]))["activations"]
    (rm,) = phases(
        load_config(None, ["sft.steps=0", "rm.max_tokens_per_micro_batch=45"]), "rm", model_shape(cfg)
    )
    assert rm.micro_rows == 2 * 3  # 3 pairs of 15-token rows, chosen and rejected


def test_plan_prints_every_role_and_the_machine(tmp_path):
    result = _cli("plan", "grpo.kl_coef=0.01")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for role in ("driver", "actor", "rollout", "ref", "env"):
        assert f"\n  {role} " in out, role
    assert "this machine:" in out and "/proc/meminfo MemTotal" in out
    assert "step FLOPs: sft train" in out and "grpo generate" in out
    assert not (ROOT / "runs" / "plan").exists()


def test_a_config_that_cannot_fit_names_its_largest_term_and_writes_nothing(tmp_path):
    out_dir = tmp_path / "run"
    for command in (["plan"], ["train", f"out_dir={out_dir}"], ["sft", f"out_dir={out_dir}"]):
        result = _cli(*command, *HUGE)
        assert result.returncode == 2, (command, result.stderr)
        line = result.stderr.strip()
        assert "\n" not in line
        assert "the largest term is actor's optimizer" in line and "model.lora.r=8" in line, line
    assert not out_dir.exists()
    # resumed: the saved config is planned, whatever the command line leaves out
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "config.yaml").write_text(
        "model:\n  tiny: {hidden_size: 4096, num_layers: 32, intermediate_size: 12000, num_heads: 32, num_kv_heads: 8}\n"
    )
    resumed = _cli("train", f"out_dir={saved}", "--resume")
    assert resumed.returncode == 2 and "the largest term is actor's optimizer" in resumed.stderr, (
        resumed.stderr
    )
    # skipped, the run goes on to its next check (here: an out_dir that is a file)
    a_file = tmp_path / "file"
    a_file.write_text("")
    result = _cli("train", *HUGE, f"out_dir={a_file}", "--no-plan-check")
    assert result.returncode == 2 and f"out_dir: '{a_file}' is a file" in result.stderr, result.stderr


def test_a_pool_s_declared_memory_is_checked(tmp_path):
    pools = tmp_path / "pools.yaml"
    pools.write_text(
        "runtime:\n  backend: ray\n  cluster: {address: '10.0.0.1:6379'}\n  placement:\n"
        "    pools: [{name: a, bundles: 1, resources: {CPU: 1, memory: 1073741824}},\n"
        "            {name: e, bundles: 1, resources: {CPU: 1}}]\n"
        "    roles: {actor: a, rollout: a, env: e}\n"
    )
    ok = _cli("plan", str(pools))
    assert ok.returncode == 0, ok.stderr
    assert "pool a (1 bundles): " in ok.stdout and "pool e (1 bundles): " in ok.stdout
    big = _cli(
        "plan",
        str(pools),
        "model.tiny.hidden_size=1024",
        "model.tiny.num_layers=8",
        "model.tiny.intermediate_size=4096",
    )
    assert big.returncode == 2
    assert "pool a (1 bundles) needs" in big.stderr and "runtime.placement pool a's memory" in big.stderr


@pytest.mark.parametrize(
    "args",
    [["missing.yaml"], ["grpo.steps=x"], ["grpo.stepz=1"]],
    ids=["missing-file", "bad-value", "unknown-field"],
)
def test_bad_input_fails_as_train_does(args, tmp_path):
    plan, train = _cli("plan", *args, cwd=tmp_path), _cli("train", *args, cwd=tmp_path)
    assert plan.returncode == train.returncode == 2
    assert plan.stderr == train.stderr and plan.stderr.startswith("loopline: ")
    assert plan.stdout == ""


# ---------------------------------------------------------------------------------------------------------
# Calibration: the plan against real runs' peaks
# ---------------------------------------------------------------------------------------------------------


def _vocab_32k_model(path: Path) -> None:
    """A random-init Qwen2-shaped directory, hidden 256, 4 layers, a 32k vocabulary, the byte tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from loopline.models.tokenizer import build_byte_tokenizer

    config = Qwen2Config(
        vocab_size=32768, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)


def _long_rows(path: Path) -> None:
    """Rows of 257 prompt and 200 completion tokens: a micro-batch whose activations dominate."""
    with path.open("w") as f:
        for i in range(16):
            f.write(
                json.dumps({"prompt": "ab " * 85 + f"{i}=", "answer": "x", "completion": "cd " * 66 + "\n"})
                + "\n"
            )


SHORT = ["sft.steps=1", "sft.eval_every=0", "eval.num_prompts=8", "eval.batch_size=8", "progress=false",
         "checkpoint_every=0", "tensorboard=false"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.e2e
def test_the_plan_is_within_25_percent_of_measured_peaks(tmp_path):
    """Three runs at once (two `loopline sft`, one GRPO step), each peak read from its own process (_peaks)."""
    model, rows = tmp_path / "m32k", tmp_path / "long.jsonl"
    _vocab_32k_model(model)
    _long_rows(rows)
    runs = {
        "vocab 32k": [f"model.path={model}", "sft.batch_size=32", "sft.micro_batch_size=32"],
        "vocab 32k grpo": [
            f"model.path={model}", "sft.steps=0", "grpo.steps=1", "grpo.prompts_per_step=4", "grpo.group_size=4",
            "grpo.micro_batch_size=16", "grpo.eval_every=0",
        ],
        "long rows": [
            "data.source=jsonl", f"data.train_path={rows}", f"data.eval_path={rows}", "data.max_seq_len=460",
            "model.tiny.hidden_size=384", "model.tiny.num_layers=6", "model.tiny.intermediate_size=1152",
            "model.tiny.num_heads=6", "model.tiny.num_kv_heads=2", "eval.sampling.max_new_tokens=4",
            "sft.batch_size=8", "sft.micro_batch_size=8",
        ],
    }  # fmt: skip
    measured = _peaks(runs, tmp_path)
    planned = {
        name: main_process_bytes(load_config(None, [*SHORT, *args]), "train" if "grpo" in name else "sft")
        for name, args in runs.items()
    }
    for name in runs:
        ratio = planned[name] / measured[name]
        print(
            f"{name}: planned {planned[name] / 2**20:.0f} MiB, measured {measured[name] / 2**20:.0f} MiB ({ratio:.2f})"
        )
        assert 0.75 <= ratio <= 1.25, (
            f"{name}: planned {planned[name] / GIB:.2f} GiB, measured {measured[name] / GIB:.2f}"
        )


def _peaks(runs: dict[str, list[str]], out: Path) -> dict[str, int]:
    """Each run's peak resident set in bytes, the runs at once: the VmHWM of its own process (/proc/PID/status,
    read every 0.05 s until it exits). Not wait4's ru_maxrss: a child started by fork or vfork then exec carries
    the parent's high-water mark into it, so inside a whole-suite run every child "peaked" at the pytest
    process's 1104 MiB."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = {}
    for name, args in runs.items():
        command = "train" if "grpo" in name else "sft"
        argv = [sys.executable, "-m", "loopline.cli", command, *SHORT, *args, f"out_dir={out / name}"]
        procs[name] = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peaks = dict.fromkeys(runs, 0)
    while any(proc.poll() is None for proc in procs.values()):
        for name, proc in procs.items():
            with contextlib.suppress(OSError, IndexError, ValueError):  # gone, or a zombie without the line
                kib = int(Path(f"/proc/{proc.pid}/status").read_text().split("VmHWM:")[1].split()[0])
                peaks[name] = max(peaks[name], kib * 1024)
        time.sleep(0.05)
    for proc in procs.values():
        assert proc.returncode == 0, proc.stderr.read().decode()[-2000:]
    return peaks


def test_rows_of_unknown_length_say_which_fields_set_it(tmp_path):
    config = tmp_path / "model" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({
        "hidden_size": 896, "num_hidden_layers": 24, "vocab_size": 151936, "intermediate_size": 4864,
        "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
    }))  # fmt: skip
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    args = [f"model.path={config.parent}", "data.source=jsonl", f"data.train_path={rows}"]
    result = _cli("plan", *args)
    assert result.returncode == 2
    assert (
        "rows are assumed as long as the model's positions: data.max_prompt_tokens and data.max_seq_len"
        in (result.stderr)
    )
    fits = _cli("plan", *args, "data.max_prompt_tokens=64", "data.max_seq_len=128", "grpo.sampling.max_new_tokens=64",
                "grpo.micro_batch_size=4", "sft.micro_batch_size=4", "eval.batch_size=16")  # fmt: skip
    assert fits.returncode == 0, fits.stderr


def _gpu_pools(gib: float, *more: str) -> list[str]:
    pools = (
        "runtime.placement.pools=[{name: gpu, bundles: 2, resources: {CPU: 4, GPU: 1}, gpu_memory_gib: "
        f"{gib}}}, {{name: e, bundles: 1, resources: {{CPU: 1}}}}]"
    )
    return ["runtime.backend=ray", "runtime.cluster.address=10.0.0.1:6379", "runtime.trainer_ranks=2", pools,
            "runtime.placement.roles={actor: gpu, rollout: gpu, env: e}", *more]  # fmt: skip


def test_a_gpu_pool_plans_one_bundle_s_gpu_memory_and_checks_it_when_declared():
    """On a GPU pool the model lives in GPU memory: one bundle's GPU holds one rank of each role placed there (a
    CUDA context and the terms a CPU rank has); the host keeps one staged copy of the weights. A declared
    gpu_memory_gib is checked like a pool's memory; vLLM takes its memory_fraction of it."""
    from loopline.errors import UserError
    from loopline.plan import CUDA_CONTEXT_BYTES, check, nodes

    cfg = load_config(None, _gpu_pools(80))
    gpu = next(n for n in nodes(cfg, "train") if "GPU memory" in n.name)
    assert gpu.capacity == 80 * GIB and [r.role for r in gpu.ranks] == ["actor", "rollout"]
    for rank in gpu.ranks:
        want = CUDA_CONTEXT_BYTES + sum(t.nbytes for t in role_terms(cfg, rank.role, "train"))
        assert rank.nbytes == want, rank.role
    host = next(n for n in nodes(cfg, "train") if n.name.startswith("pool gpu (2 bundles)"))
    assert {t.name for r in host.ranks for t in r.terms} == {"runtime", "params"}  # staged weights only
    check(cfg, "train")  # fits 80 GiB

    small = load_config(None, _gpu_pools(0.001))
    with pytest.raises(
        UserError, match=r"plan: pool gpu: GPU memory of one bundle \(1 GPU\) needs .* has 0\.00 GiB"
    ):
        check(small, "train")
    undeclared = load_config(None, _gpu_pools(0))
    assert next(n for n in nodes(undeclared, "train") if "GPU memory" in n.name).capacity is None
    check(undeclared, "train")  # printed, not checked

    vllm = load_config(None, _gpu_pools(80, "rollout.engine=vllm", "rollout.vllm.memory_fraction=0.5"))
    engine = next(
        r for n in nodes(vllm, "train") if "GPU memory" in n.name for r in n.ranks if r.role == "rollout"
    )
    assert engine.nbytes == CUDA_CONTEXT_BYTES + 40 * GIB  # vLLM reserves half the GPU, weights and cache


def _engine_pool(*more: str) -> list[str]:
    """A 1.5B shape whose engine has a 24 GiB GPU of its own, 512 new tokens in training."""
    pools = (
        "runtime.placement.pools=[{name: gpu, bundles: 1, resources: {CPU: 4, GPU: 1}, gpu_memory_gib: 400}, "
        "{name: eng, bundles: 1, resources: {CPU: 4, GPU: 1}, gpu_memory_gib: 24}, "
        "{name: e, bundles: 1, resources: {CPU: 1}}]"
    )
    return ["model.preset=qwen2.5-1.5b", "model.init=random", "runtime.backend=ray", pools,
            "runtime.cluster.address=10.0.0.1:6379", "runtime.placement.roles={actor: gpu, rollout: eng, env: e}",
            "grpo.sampling.max_new_tokens=512", *more]  # fmt: skip


def test_the_advice_names_the_setting_that_sizes_the_engine_s_cache():
    """The KV cache is the larger of a step's rows and the held-out prompts scored at once (eval.batch_size, 1000 by
    default), each at most runtime.engine_max_rows: a plan that does not fit names the one that sized it, and
    following that advice makes it fit."""
    from loopline.errors import UserError
    from loopline.plan import check

    def advice(*more: str) -> str:
        with pytest.raises(UserError, match=r"the largest term is rollout's kv_cache") as got:
            check(load_config(None, _engine_pool(*more)), "train")
        return str(got.value).split("to shrink it, ", 1)[1]

    # 1000 held-out prompts x (9 + 512) tokens: more than the step's 64 x 8 rows of as many
    held_out = advice("eval.sampling.max_new_tokens=512")
    assert held_out.startswith("eval.batch_size (held-out prompts generated at once)"), held_out
    check(load_config(None, _engine_pool("eval.sampling.max_new_tokens=512", "eval.batch_size=64")), "train")
    check(
        load_config(None, _engine_pool("eval.sampling.max_new_tokens=512", "runtime.engine_max_rows=64")),
        "train",
    )
    # the step's rows (2048 prompts x 8 samples) outgrow the held-out prompts: the engine's rows are named
    step = advice("eval.sampling.max_new_tokens=512", "grpo.prompts_per_step=2048")
    assert step.startswith("runtime.engine_max_rows (rows an engine runs at once)"), step
    assert "eval.batch_size" not in step
    cfg = load_config(None, _engine_pool("eval.batch_size=8"))
    (_, grpo) = phases(cfg, "train", model_shape(cfg))
    # the step's rows x tokens x layers x (k, v) x kv heads x head dim x fp32
    assert _terms(cfg, "rollout")["kv_cache"] == 64 * 8 * grpo.seq * 28 * 2 * 2 * 128 * 4
