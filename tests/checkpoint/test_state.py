"""Checkpoints: whole-or-nothing directories, a `latest` pointer, pruning, and exact reloads."""

from __future__ import annotations

import copy
import json
import random

import numpy as np
import pytest
import torch

from loopline.checkpoint.state import CheckpointParts, RunState, checkpoint_root, latest_checkpoint, rng_state
from loopline.models.load import build_tiny_model


def _save(run_dir, model, tokenizer, phase, step, keep_last=3):
    """A checkpoint of `model` through the one checkpoint writer (its local actor writes the shards)."""
    from loopline.runtime.actor import local_actor

    state = RunState(phase=phase, step=step, sampler={"epoch": 0, "position": step, "size": 10, "seed": 1})
    _checkpointer(run_dir, local_actor(model), model, tokenizer, keep_last=keep_last).save(state)
    return checkpoint_root(run_dir) / f"{phase}-{step:06d}"


def test_save_then_load_restores_everything(tmp_path, small_model, tokenizer, small_cfg):
    with torch.no_grad():
        small_model.model.norm.weight.add_(0.5)  # differ from a fresh init
    torch.manual_seed(11)
    random.seed(12)
    np.random.seed(13)
    expected_rng = rng_state()
    path = _save(tmp_path, small_model, tokenizer, "grpo", 4)
    assert path.name == "grpo-000004"
    assert json.loads((path / "state.json").read_text())["step"] == 4

    from loopline.runtime.actor import local_actor

    fresh = build_tiny_model(small_cfg, tokenizer, seed=1)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    state, parts = _checkpointer(tmp_path, local_actor(fresh), fresh, tokenizer).resume()
    assert state == RunState("grpo", 4, {"epoch": 0, "position": 4, "size": 10, "seed": 1})
    assert parts == CheckpointParts(dcp=str(path / "dcp"))  # the optimizer shards (none before a phase)
    for name, tensor in small_model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()  # still tied
    assert torch.equal(torch.get_rng_state(), expected_rng["torch"])
    assert (random.random(), np.random.rand()) == (
        random.Random(12).random(),
        np.random.RandomState(13).rand(),
    )


def test_latest_points_at_the_newest_whole_checkpoint(tmp_path, small_model, tokenizer):
    assert latest_checkpoint(tmp_path) is None
    _save(tmp_path, small_model, tokenizer, "sft", 3)
    assert latest_checkpoint(tmp_path).name == "sft-000003"
    _save(tmp_path, small_model, tokenizer, "grpo", 2)
    assert latest_checkpoint(tmp_path).name == "grpo-000002"


def test_the_scan_takes_the_newest_whole_checkpoint_and_passes_over_damaged_newer_ones(
    tmp_path, small_model, tokenizer
):
    from loopline.checkpoint.state import newest_whole_checkpoint
    from loopline.errors import UserError

    assert newest_whole_checkpoint(tmp_path) == (None, [])  # no checkpoint: a fresh run
    for phase, step in (("sft", 9), ("grpo", 2), ("grpo", 10)):  # by age: SFT before RL, steps as numbers
        _save(tmp_path, small_model, tokenizer, phase, step, keep_last=0)
    root = checkpoint_root(tmp_path)
    assert newest_whole_checkpoint(tmp_path) == (root / "grpo-000010", [])
    # the newest's shard cut short (a disk filled mid-write): the one before it, and why the newest was passed
    shard = next((root / "grpo-000010" / "dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    path, skipped = newest_whole_checkpoint(tmp_path)
    assert path == root / "grpo-000002"
    assert [(p.name, fault.split(":")[0]) for p, fault in skipped] == [("grpo-000010", "dcp/" + shard.name)]
    # the next one's RNG file unreadable as well: past both, to the SFT checkpoint
    (root / "grpo-000002" / "rng.pt").write_bytes(b"not a torch file")
    path, skipped = newest_whole_checkpoint(tmp_path)
    assert path == root / "sft-000009" and [p.name for p, _ in skipped] == ["grpo-000010", "grpo-000002"]
    assert skipped[1][1].startswith("rng.pt: ")
    # every one damaged: refused, naming them, rather than a fresh start over the run's files
    (root / "sft-000009" / "state.json").write_text("{")
    with pytest.raises(UserError, match="every one is damaged: .*grpo-000010.*grpo-000002.*sft-000009"):
        newest_whole_checkpoint(tmp_path)


def test_leftover_tmp_dir_is_ignored_then_replaced(tmp_path, small_model, tokenizer):
    _save(tmp_path, small_model, tokenizer, "grpo", 2)
    # a crash while writing step 4 leaves a half-written temporary directory behind
    half = checkpoint_root(tmp_path) / ".tmp-grpo-000004"
    (half / "model").mkdir(parents=True)
    (half / "state.json").write_text('{"phase": "grpo", "step": 4')
    assert latest_checkpoint(tmp_path).name == "grpo-000002"
    # it does not count as a checkpoint for pruning either
    for step in (3, 5):
        _save(tmp_path, small_model, tokenizer, "grpo", step, keep_last=2)
    names = sorted(p.name for p in checkpoint_root(tmp_path).iterdir() if p.is_dir())
    assert names == [".tmp-grpo-000004", "grpo-000003", "grpo-000005"]
    # and writing that step again starts from a clean temporary directory
    path = _save(tmp_path, small_model, tokenizer, "grpo", 4, keep_last=5)
    assert not half.exists()
    assert json.loads((path / "state.json").read_text())["step"] == 4


def test_keep_last_keeps_the_newest(tmp_path, small_model, tokenizer):
    _save(tmp_path, small_model, tokenizer, "sft", 600)
    for step in range(1, 6):
        _save(tmp_path, small_model, tokenizer, "grpo", step, keep_last=3)
    names = sorted(p.name for p in checkpoint_root(tmp_path).iterdir() if p.is_dir())
    # SFT comes before RL: the three newest are the last three RL checkpoints
    assert names == ["grpo-000003", "grpo-000004", "grpo-000005"]
    assert latest_checkpoint(tmp_path).name == "grpo-000005"


def test_keep_last_zero_keeps_everything(tmp_path, small_model, tokenizer):
    for step in range(1, 5):
        _save(tmp_path, small_model, tokenizer, "grpo", step, keep_last=0)
    assert len([p for p in checkpoint_root(tmp_path).iterdir() if p.is_dir()]) == 4


def test_checkpoint_model_dir_loads_with_transformers(tmp_path, small_model, tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _save(tmp_path, small_model, tokenizer, "grpo", 1)
    model = AutoModelForCausalLM.from_pretrained(path / "model")
    tok = AutoTokenizer.from_pretrained(path / "model")
    ids = torch.tensor([tok("1+2=")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, small_model.eval()(input_ids=ids).logits)


# ---------------------------------------------------------------------------------------------------------
# Checkpointer: what `loopline train` uses (the actor writes DCP shards)
# ---------------------------------------------------------------------------------------------------------


def _actor(model):
    from loopline.config import OptimConfig
    from loopline.runtime.actor import local_actor

    actor = local_actor(model)
    actor.start_phase(OptimConfig(lr=1e-2, warmup_steps=1, schedule="cosine"), 10, None)
    return actor


def _train_step(actor, seed):
    from loopline.data.batches import collate

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 259, (4,), generator=g).tolist() for _ in range(4)]
    responses = [torch.randint(3, 259, (3,), generator=g).tolist() for _ in range(4)]
    actor.sft_step(collate(prompts, responses, pad_id=0), micro_batch_size=2)


def _checkpointer(run_dir, actor, model, tokenizer, **cfg):
    from loopline.checkpoint.state import Checkpointer
    from loopline.config import CheckpointConfig

    return Checkpointer(run_dir, CheckpointConfig(**cfg), actor, model, tokenizer)


def test_checkpointer_resume_restores_weights_optimizer_rng_and_cuts_run_files(
    tmp_path, tokenizer, small_cfg
):
    from loopline.checkpoint.ledger import Ledger, read_ledger
    from loopline.config import OptimConfig
    from loopline.metrics.logger import MetricsLogger, read_metrics

    model = build_tiny_model(small_cfg, tokenizer, seed=0)
    actor = _actor(model)
    logger, ledger = MetricsLogger(tmp_path, tensorboard=False), Ledger(tmp_path)
    for step in (1, 2):
        _train_step(actor, step)
        logger.log({"phase": "sft", "step": step})
        ledger.record("sft", step, [(0, step, 0)])
    torch.manual_seed(5)
    expected_rng = torch.get_rng_state()
    state = RunState("sft", 2, {"epoch": 0, "position": 2, "size": 10, "seed": 0}, policy_version=0)
    _checkpointer(tmp_path, actor, model, tokenizer).save(state)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_optim = copy.deepcopy(
        actor.group.local().trainer.state_dict()
    )  # AdamW's step counts are live tensors
    # the run goes on past the checkpoint, then dies: its later rows must go (a half line too)
    _train_step(actor, 3)
    logger.log({"phase": "sft", "step": 3})
    ledger.record("sft", 3, [(0, 3, 0)])
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"phase": "sft", "st')

    fresh = build_tiny_model(small_cfg, tokenizer, seed=7)
    from loopline.runtime.actor import local_actor

    resumed_actor = local_actor(fresh)
    resumed, parts = _checkpointer(tmp_path, resumed_actor, fresh, tokenizer).resume()
    assert resumed == state
    for name, tensor in expected.items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    assert torch.equal(torch.get_rng_state(), expected_rng)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert [r["step"] for r in read_ledger(tmp_path)] == [1, 2]
    resumed_actor.start_phase(OptimConfig(lr=1e-2, warmup_steps=1, schedule="cosine"), 10, parts)
    got_optim = resumed_actor.group.local().trainer.state_dict()
    assert got_optim["scheduler"] == expected_optim["scheduler"]
    for name, moments in expected_optim["optimizer"]["state"].items():
        for key, value in moments.items():
            assert torch.equal(got_optim["optimizer"]["state"][name][key], value), (name, key)


def test_async_save_writes_the_state_of_the_call(tmp_path, tokenizer, small_cfg):
    from safetensors.torch import load_file

    model = build_tiny_model(small_cfg, tokenizer, seed=0)
    actor = _actor(model)
    _train_step(actor, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    checkpoints = _checkpointer(tmp_path, actor, model, tokenizer, async_save=True)
    checkpoints.save(RunState("grpo", 1))
    _train_step(actor, 2)  # changes the weights in place while the write may still run
    checkpoints.wait()
    assert latest_checkpoint(tmp_path).name == "grpo-000001"
    saved = load_file(checkpoint_root(tmp_path) / "grpo-000001" / "model" / "model.safetensors")
    for name, tensor in saved.items():
        assert torch.equal(tensor, before[name]), name
    assert any(not torch.equal(model.state_dict()[k], before[k]) for k in before)
    fresh = build_tiny_model(small_cfg, tokenizer, seed=3)
    from loopline.checkpoint.state import load_weights

    load_weights(checkpoint_root(tmp_path) / "grpo-000001", fresh)  # the DCP shards agree
    for name, tensor in before.items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


def test_export_writes_a_transformers_model_from_the_shards(tmp_path, tokenizer, small_cfg):
    from transformers import AutoModelForCausalLM

    from loopline.cli import main

    model = build_tiny_model(small_cfg, tokenizer, seed=0)
    actor = _actor(model)
    _train_step(actor, 1)
    _checkpointer(tmp_path / "run", actor, model, tokenizer, hf_model=False).save(RunState("grpo", 1))
    ckpt = checkpoint_root(tmp_path / "run") / "grpo-000001"
    assert not (ckpt / "model" / "model.safetensors").exists()  # only the DCP shards hold the weights
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0  # a run dir: its newest
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = torch.tensor([tokenizer("12+34=")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(exported(input_ids=ids).logits, model.eval()(input_ids=ids).logits)


def test_lora_checkpoint_exports_and_saves_merged_weights(tmp_path, tokenizer, small_cfg):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from loopline.checkpoint.export import export
    from loopline.config import RunConfig, save_config
    from loopline.training.lora import apply_lora, merged_state_dict

    cfg = RunConfig.model_validate({"model": {"lora": {"r": 4}}})
    (tmp_path / "run").mkdir()
    save_config(cfg, tmp_path / "run" / "config.yaml")  # as build_context writes it
    model = apply_lora(build_tiny_model(small_cfg, tokenizer, seed=0), cfg.model.lora)
    actor = _actor(model)
    _train_step(actor, 1)  # moves the adapters only
    _checkpointer(tmp_path / "run", actor, model, tokenizer).save(RunState("grpo", 1))
    merged = merged_state_dict(model)
    saved = load_file(checkpoint_root(tmp_path / "run") / "grpo-000001" / "model" / "model.safetensors")
    assert not any("lora_" in k for k in saved)
    for name, tensor in saved.items():
        assert torch.equal(tensor, merged[name]), name
    exported = AutoModelForCausalLM.from_pretrained(export(tmp_path / "run", tmp_path / "hf"))
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, merged[name]), name


def test_a_failed_save_in_flight_is_raised_by_the_next_wait_or_dropped_by_abandon() -> None:
    """SaveInFlight: the background finish's failure reaches the loop's thread at its next wait(); abandon() (the
    ranks writing it were lost, a heal or a restart) drops it; a blocking run() raises it at once."""
    import threading

    from loopline.checkpoint.state import SaveInFlight

    def fail() -> None:
        raise OSError("disk full")

    saves = SaveInFlight(timeout_s=5.0)
    saves.start(fail, "checkpoint-a")
    with pytest.raises(RuntimeError, match="checkpoint failed: OSError: disk full"):
        saves.wait()
    saves.wait()  # raised once, then nothing is in flight

    saves.start(fail, "checkpoint-b")
    saves.abandon()
    saves.wait()  # dropped

    release = threading.Event()
    saves.start(release.wait, "checkpoint-c")
    slow = SaveInFlight(timeout_s=0.0)
    slow.start(threading.Event().wait, "checkpoint-d")  # never finishes
    with pytest.raises(TimeoutError, match="did not finish within 0s"):
        slow.wait()
    release.set()
    saves.wait()

    with pytest.raises(RuntimeError, match="disk full"):
        SaveInFlight(timeout_s=5.0).run(fail)

    # a trainer rank lost under the save: its WorkerError as it is, which the run's recovery catches (a restart
    # from the last whole checkpoint), not a RuntimeError that would end the run
    from loopline.distributed.workers import WorkerDiedError

    def lost() -> None:
        raise WorkerDiedError("actor", 1, "wait_saved", "the rank's actor died")

    saves.start(lost, "checkpoint-e")
    with pytest.raises(WorkerDiedError, match="role 'actor' rank 1 wait_saved"):
        saves.wait()


def test_hf_weights_are_written_as_safetensors_reads_them_one_tensor_at_a_time(tmp_path) -> None:
    """write_hf_weights writes the safetensors format itself, tensor by tensor: safetensors reads back every
    dtype and shape bitwise, and a mapping that makes its tensors when read (a LoRA model's MergedWeights) has at
    most one of them alive at a time, never a copy of the whole model."""
    import weakref
    from collections.abc import Mapping

    from safetensors.torch import load_file

    from loopline.checkpoint.dcp import write_hf_weights

    g = torch.Generator().manual_seed(0)
    want = {
        "a.weight": torch.randn(3, 5, generator=g),
        "b.half": torch.randn(7, generator=g).to(torch.bfloat16),
        "c.ids": torch.arange(6, dtype=torch.int64).view(2, 3),
        "d.flag": torch.tensor([True, False, True]),
        "e.scalar": torch.tensor(2.5, dtype=torch.float64),
        "f.empty": torch.zeros(0, 4),
        "g.strided": torch.randn(4, 6, generator=g).t(),  # not contiguous
    }
    write_hf_weights(torch.nn.Linear(1, 1), want, tmp_path)
    got = load_file(tmp_path / "model.safetensors")
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k

    class Made(Mapping):
        """Each read makes a new 1 MiB tensor; counts how many are alive at once."""

        def __init__(self) -> None:
            self.alive = self.most = 0

        def __getitem__(self, name: str) -> torch.Tensor:
            t = torch.full((2**18,), float(int(name)))
            self.alive += 1
            self.most = max(self.most, self.alive)
            weakref.finalize(t, self._freed)
            return t

        def _freed(self) -> None:
            self.alive -= 1

        def __iter__(self):
            return iter(str(i) for i in range(20))

        def __len__(self) -> int:
            return 20

    made = Made()
    write_hf_weights(torch.nn.Linear(1, 1), made, tmp_path / "made")
    assert made.most <= 2  # the one being written and, at most, the next being made
    assert torch.equal(load_file(tmp_path / "made" / "model.safetensors")["19"], torch.full((2**18,), 19.0))
