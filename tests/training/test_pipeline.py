"""Pipeline parallelism: pp=2 and pp=2 x dp=2 make the same update as one rank, and sizes that do not fit fail.

The one-rank reference is `PolicyTrainer` on the whole global batch in this process; the pipelined ranks are
real spawned gloo processes (one world of 2 ranks, one of 4) running `PipelineTrainer` over FSDP2-wrapped
stages. Each case takes two steps on batches of different shapes (rows and width: the second needs a new
schedule) with uneven response lengths and an empty response, so only global-token normalisation comes out
right. Compared: every step's whole gradients by name (before AdamW, which would hide a wrong scale), the
weights after the steps, and the reported statistics; also the log-probs every pp rank gets.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from torch import nn

from loopline.bench.sync import run_world
from loopline.config import ConfigError, GRPOConfig, OptimConfig, SamplingConfig, TinyModelConfig, load_config
from loopline.data.batches import RolloutBatch, TokenBatch, collate, split_rows
from loopline.models.load import build_tiny_model
from loopline.models.tokenizer import build_byte_tokenizer
from loopline.preflight import check_run
from loopline.runtime.config import RuntimeConfig
from loopline.training.pipeline import (
    MAX_SCHEDULES,
    PipelineTrainer,
    StageModule,
    check_pp,
    full_pipeline_state,
    pad_batch,
    padded_shape,
    parallelize_stages,
    pp_mesh,
    rank_stages,
    split_model,
    stage_layers,
)
from loopline.training.policy import PolicyTrainer, grpo_loss, response_logprobs
from tests.numerics import assert_adam_updates_close

# 4 layers: 2 stages, or 4 with interleaved (2 per rank)
TINY = TinyModelConfig(hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=64)
OPTIM = OptimConfig(lr=1e-3, warmup_steps=0, grad_clip=1.0)
MAX_NEW = 9
MICRO = 2  # rows per micro-batch


class Case(NamedTuple):
    """One pipelined run compared with one rank. kind: "sft", or the grpo.loss_agg of a policy step.

    bucket 1 runs each batch at its own width, as the one rank does; bucket 8 pads columns (12 -> 16,
    19 -> 24). Padding and TP change float rounding; gradients still agree within 1e-6, but AdamW divides each
    element by its own RMS (eps 1e-8), so an element whose gradient is ~1e-9 moves by a different share of lr
    when its rounding differs: those cases compare the weights within 1e-5.
    """

    name: str
    schedule: str
    tied: bool
    kind: str
    bucket: int = 1
    tp: int = 1
    max_schedules: int = MAX_SCHEDULES  # 1: every change of shape or of train/eval builds a schedule afresh


CASES_PP2 = [
    *[Case(f"sft-{s}-tied", s, True, "sft") for s in ("gpipe", "1f1b", "interleaved")],
    Case("sft-1f1b-untied", "1f1b", False, "sft"),
    *[
        Case(f"grpo-{s}-{'tied' if t else 'untied'}", s, t, "token_mean")
        for s in ("gpipe", "1f1b", "interleaved")
        for t in (True, False)
    ],
    Case("grpo-1f1b-tied-seq_mean", "1f1b", True, "seq_mean"),
    Case("grpo-1f1b-tied-fixed_length", "1f1b", True, "fixed_length", max_schedules=1),
    Case("grpo-1f1b-tied-padded", "1f1b", True, "token_mean", bucket=8),
    Case("sft-interleaved-untied-padded", "interleaved", False, "sft", bucket=8),
]
# 4 ranks: pp=2 x dp=2, and pp=2 x tp=2 (dp=1)
CASES_4 = [
    Case("sft-1f1b-tied", "1f1b", True, "sft"),
    Case("sft-1f1b-untied", "1f1b", False, "sft"),
    Case("grpo-1f1b-tied", "1f1b", True, "token_mean"),
    Case("grpo-1f1b-untied", "1f1b", False, "token_mean"),
    Case("grpo-interleaved-tied", "interleaved", True, "token_mean"),
    Case("grpo-gpipe-untied-seq_mean", "gpipe", False, "seq_mean"),
    Case("grpo-1f1b-untied-padded", "1f1b", False, "token_mean", bucket=8),
    Case("tp2-grpo-1f1b-tied", "1f1b", True, "token_mean", tp=2),
    Case("tp2-sft-interleaved-untied", "interleaved", False, "sft", tp=2),
]


def _model(tied: bool) -> nn.Module:
    model = build_tiny_model(TINY, build_byte_tokenizer(), seed=0)
    if not tied:  # an untied head: its own weights, near the embeddings
        g = torch.Generator().manual_seed(1)
        emb = model.model.embed_tokens.weight.detach()
        model.lm_head.weight = nn.Parameter(emb + 0.02 * torch.randn(emb.shape, generator=g))
        model.config.tie_word_embeddings = False
    return model


def _rollout(seed: int, p_lens: list[int], r_lens: list[int]) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 259, (n,), generator=g).tolist() for n in p_lens]
    responses = [torch.randint(3, 259, (n,), generator=g).tolist() for n in r_lens]
    tokens = collate(prompts, responses, pad_id=0)
    with torch.no_grad():
        current, _ = response_logprobs(_model(True), tokens)
    # behaviour and reference log-probs off by up to +-0.4 nats: some ratios clip; behaviour weights near 1
    noise = [torch.rand(current.shape, generator=g) - 0.5 for _ in range(3)]
    return RolloutBatch(
        tokens.input_ids, tokens.attention_mask, tokens.response_mask,
        old_logprobs=current + 0.8 * noise[0], ref_logprobs=current + 0.8 * noise[1],
        advantages=torch.randn(len(p_lens), generator=g), rewards=torch.zeros(len(p_lens)),
        is_weights=1.0 + 0.2 * noise[2],
    )  # fmt: skip


def _batches() -> list[RolloutBatch]:
    """Two steps' global batches: 8 rows of width 12, then 8 rows of width 19 (another bucket). The same rows and
    micro-batches: only the width tells the second step's shapes from the first's."""
    return [
        _rollout(3, [3, 6, 2, 4, 5, 2, 3, 6], [6, 5, 4, 6, 1, 0, 2, 5]),
        _rollout(4, [9, 4, 10, 7, 3, 8, 2, 5], [9, 3, 0, 8, 5, 1, 7, 2]),
    ]


def _grpo_cfg(loss_agg: str) -> GRPOConfig:
    return GRPOConfig(
        loss_agg=loss_agg, micro_batch_size=MICRO, kl_coef=0.05, entropy_coef=0.01,
        sampling=SamplingConfig(max_new_tokens=MAX_NEW),
    )  # fmt: skip


def _full_grads(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Whole gradients by name (DTensors gathered: every rank of a stage calls this in the same order)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for module in modules:
        for name, p in module.named_parameters():
            g = p.grad
            assert g is not None, name
            out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


@contextlib.contextmanager
def _recording_grads(optimizer: torch.optim.Optimizer, modules: list[nn.Module]) -> Iterator[list]:
    """The whole gradients of `modules` as each optimizer step starts (after clipping), one dict per step."""
    grads: list = []
    hook = optimizer.register_step_pre_hook(lambda *_: grads.append(_full_grads(modules)))
    try:
        yield grads
    finally:
        hook.remove()


def _full_weights(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for module in modules:
        for name, p in module.named_parameters():
            out[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
    return out


def _steps(trainer, batches: list, kind: str, micro: int) -> list:
    """One step per batch: sft_step, or policy_step at grpo.kl_coef; the stats of each."""
    if kind == "sft":
        return [trainer.sft_step(b, micro) for b in batches]
    return [trainer.policy_step(b, _grpo_cfg(kind).kl_coef) for b in batches]


def _stats(stats: list) -> list[dict[str, float]]:
    return [{"loss": s.loss, "grad_norm": s.grad_norm, **s.extra} for s in stats]


def _rank_main(rank: int, world: int, pp: int, cases: list[Case], out: str) -> None:
    """One pipelined rank: its dp slice of each batch; saves its grads, weights, stats and log-probs per case."""
    meshes = {tp: pp_mesh(world, pp, tp) for tp in sorted({c.tp for c in cases})}  # every rank makes each
    results = {}
    for case in cases:
        mesh = meshes[case.tp]
        pp_rank, dp_rank, tp_rank = mesh.get_coordinate()
        dp = mesh["dp"].size()
        batches = [split_rows(b, len(b) // dp)[dp_rank] for b in _batches()]
        virtual = 2 if case.schedule == "interleaved" else 1
        stages = parallelize_stages(split_model(_model(case.tied), pp_rank, pp, virtual), mesh)
        loss = None if case.kind == "sft" else grpo_loss(_grpo_cfg(case.kind))
        trainer = PipelineTrainer(
            stages, mesh, OPTIM, 10, case.schedule, loss, MICRO, width_bucket=case.bucket
        )
        trainer.max_schedules = case.max_schedules
        logprobs = [trainer.logprobs(b) for b in batches]  # before any update
        with _recording_grads(trainer.optimizer, list(stages)) as grads:
            stats = _stats(_steps(trainer, batches, case.kind, MICRO))
        results[case.name] = {
            "coord": (pp_rank, dp_rank, tp_rank), "dp": dp, "grads": grads, "weights": _full_weights(stages),
            "stats": stats, "logprobs": logprobs, "full_state": full_pipeline_state(stages, mesh),
        }  # fmt: skip
    torch.save(results, Path(out) / f"rank{rank}.pt")


def _single(cases: list[Case]) -> dict:
    """The one-rank reference: PolicyTrainer on the whole batches, micro-batches of MICRO rows."""
    out = {}
    for case in cases:
        model = _model(case.tied)
        loss = None if case.kind == "sft" else grpo_loss(_grpo_cfg(case.kind))
        trainer = PolicyTrainer(model, OPTIM, total_steps=10, loss=loss, micro_batch_size=MICRO)
        with _recording_grads(trainer.optimizer, [model]) as grads:
            stats = _stats(_steps(trainer, copy.deepcopy(_batches()), case.kind, MICRO))
        out[case.name] = {"grads": grads, "weights": dict(model.state_dict()), "stats": stats}
    return out


def _pipelined(tmp: Path, world: int, pp: int, cases: list[Case]) -> tuple[dict, dict]:
    """Spawn the world; (per case: the stages' results merged by parameter name, every rank's own results)."""
    run_world(_rank_main, world, args=(pp, cases, str(tmp)), timeout_s=300)
    ranks = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]
    merged = {}
    for case in cases:
        # dp rank 0, tp rank 0 of each stage holds whole gradients and weights (gathered over dp and tp)
        per = sorted(
            (r[case.name] for r in ranks if r[case.name]["coord"][1:] == (0, 0)), key=lambda r: r["coord"]
        )
        assert [p["coord"][0] for p in per] == list(range(pp))
        merged[case.name] = {
            "grads": [
                {k: v for p in per for k, v in p["grads"][i].items()} for i in range(len(per[0]["grads"]))
            ],
            "weights": {k: v for p in per for k, v in p["weights"].items()},
            "stats": [r[case.name]["stats"] for r in ranks],  # every rank reports the global statistics
            "full_state": [r[case.name]["full_state"] for r in ranks],
        }
    return merged, {case.name: [r[case.name] for r in ranks] for case in cases}


@pytest.fixture(scope="module")
def pp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, dict]:
    merged, logprobs = _pipelined(tmp_path_factory.mktemp("pp2"), 2, 2, CASES_PP2)
    return _single(CASES_PP2), merged, logprobs


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, dict]:
    merged, logprobs = _pipelined(tmp_path_factory.mktemp("four"), 4, 2, CASES_4)
    return _single(CASES_4), merged, logprobs


def _assert_same_update(single: dict, piped: dict, tied: bool) -> None:
    # gradients of every step, whole (a wrong denominator, a missing tied-gradient sum, a scale by the number
    # of micro-batches or a stale shape shows there), then the weights by the rule for two reduction orders
    # under AdamW (tests/numerics.py: a key bias's true gradient is 0, so its AdamW update is rounding noise)
    assert len(piped["grads"]) == len(single["grads"]) == 2
    expected = []
    for one in single["grads"]:
        one = dict(one)
        if tied:  # one parameter under two names: the head's copy gets the embeddings' summed gradient
            assert "lm_head.weight" not in one
            one["lm_head.weight"] = one["model.embed_tokens.weight"]
        expected.append(one)
    w1, w2 = single["weights"], piped["weights"]
    assert w2.keys() == w1.keys()  # the stages' names are the whole model's
    w0 = _model(tied).state_dict()
    assert_adam_updates_close(
        w0, w1, w2, lrs=[OPTIM.lr] * 2, grads_a=expected, grads_b=piped["grads"],
        betas=OPTIM.betas, grad_rtol=0, grad_atol=1e-6,
    )  # fmt: skip
    # full_pipeline_state: the whole state_dict on global rank 0 only, as the unsplit model names it
    on_rank0, *elsewhere = piped["full_state"]
    assert on_rank0.keys() == w1.keys() and all(s == {} for s in elsewhere)
    for name in w1:
        assert torch.equal(on_rank0[name], w2[name]), name
    assert max(float((w1[n] - w0[n]).abs().max()) for n in w1) > 1e-4  # the steps did move the weights
    for stage_stats in piped["stats"]:
        for s1, s2 in zip(single["stats"], stage_stats):
            assert s1.keys() == s2.keys()
            assert all(math.isfinite(v) for v in s1.values())
            for key in s1:
                assert s2[key] == pytest.approx(s1[key], rel=1e-5, abs=1e-6), key


def _assert_logprobs(got: list[torch.Tensor], batches: list[TokenBatch], tied: bool) -> None:
    model = _model(tied)
    for logp, batch in zip(got, batches):
        with torch.no_grad():
            expected, _ = response_logprobs(model, batch)
        mask = batch.response_mask
        torch.testing.assert_close(logp * mask, expected * mask, rtol=0, atol=1e-6)


@pytest.mark.gloo  # spawned pipeline ranks (the rest of this module runs in one process: unit)
@pytest.mark.parametrize("case", CASES_PP2, ids=[c.name for c in CASES_PP2])
def test_pp2_updates_like_one_rank(pp2: tuple[dict, dict, dict], case: Case) -> None:
    single, merged, _ = pp2
    _assert_same_update(single[case.name], merged[case.name], case.tied)


@pytest.mark.gloo  # spawned pipeline ranks (the rest of this module runs in one process: unit)
@pytest.mark.parametrize("case", CASES_4, ids=[c.name for c in CASES_4])
def test_pp2_dp2_and_pp2_tp2_update_like_one_rank(four: tuple[dict, dict, dict], case: Case) -> None:
    single, merged, _ = four
    _assert_same_update(single[case.name], merged[case.name], case.tied)


@pytest.mark.gloo  # spawned pipeline ranks (the rest of this module runs in one process: unit)
def test_every_rank_gets_the_last_stages_logprobs(pp2: tuple, four: tuple) -> None:
    """Log-probs computed on the last stage reach every stage's ranks, for each rank's own dp slice."""
    for world, cases, (_, _, by_case) in ((2, CASES_PP2, pp2), (4, CASES_4, four)):
        for case in cases:
            ranks = by_case[case.name]
            assert len(ranks) == world
            for r in ranks:
                slices = [split_rows(b, len(b) // r["dp"])[r["coord"][1]] for b in _batches()]
                _assert_logprobs(r["logprobs"], slices, case.tied)


# ---------------------------------------------------------------- one process: the split, the sizes


def test_stages_keep_the_whole_models_names_and_chain_to_its_logprobs() -> None:
    """Two stages built as two ranks would (each from its own copy): the union of their parameters is the
    model's, under the same names, and feeding one into the other gives the model's log-probs."""
    model = _model(True)
    first, last = split_model(_model(True), 0, 2)[0], split_model(_model(True), 1, 2)[0]
    names = {n for s in (first, last) for n, _ in s.named_parameters()}
    assert names == set(model.state_dict())  # embed on the first, lm_head (its tied copy) on the last
    assert [n for n in first.model.layers] == ["0", "1"] and [n for n in last.model.layers] == ["2", "3"]
    batch = _batches()[1]
    labels = torch.cat([batch.input_ids[:, 1:], torch.zeros_like(batch.input_ids[:, :1])], dim=1)
    with torch.no_grad():
        hidden = first(batch.input_ids, batch.attention_mask, labels)
        out = last(hidden, batch.attention_mask, labels)  # (B, L, 2)
        expected, _ = response_logprobs(model, batch)
    c = batch.response_mask.shape[1]
    got = out[:, -c - 1 : -1, 0]
    mask = batch.response_mask
    torch.testing.assert_close(got * mask, expected * mask, rtol=0, atol=1e-6)
    assert isinstance(first, StageModule) and hidden.shape == (*batch.input_ids.shape, TINY.hidden_size)
    assert first.tied and last.tied and not split_model(_model(False), 1, 2)[0].tied


def test_stage_sizes() -> None:
    assert stage_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert rank_stages(1, 2, 2) == [1, 3] and rank_stages(0, 4) == [0]  # loop order: last stage on rank pp-1
    # 5 rows in micro-batches of 2 -> 3, rounded up to a multiple of pp=2; width 19 -> 24
    assert padded_shape(5, 19, 2, 2, 8) == (4, 24)
    with pytest.raises(
        ValueError, match="4 decoder layers do not divide by trainer_pp \\* trainer_pp_virtual = 3 \\* 1"
    ):
        check_pp(4, 3)
    with pytest.raises(ValueError, match="do not divide by trainer_pp \\* trainer_pp_virtual = 2 \\* 4"):
        split_model(_model(True), 0, 2, 4)


def test_padding_trains_nothing() -> None:
    """Padded rows repeat a real row with no response tokens; padded columns are attention padding."""
    batch = _batches()[0]
    padded = pad_batch(batch, 10, 16)
    assert padded.input_ids.shape == (10, 16) and padded.response_mask.shape == (10, 10)
    assert float(padded.response_mask.sum()) == float(batch.response_mask.sum())
    assert (
        torch.equal(padded.input_ids[8, :12], batch.input_ids[0])
        and int(padded.input_ids[8, 12:].abs().sum()) == 0
    )
    assert int(padded.attention_mask[:, 12:].sum()) == 0 and padded.advantages.shape == (10,)
    with pytest.raises(ValueError, match="cannot pad"):
        pad_batch(batch, 4, 16)


def test_the_trainer_refuses_an_unknown_schedule_or_stages_it_cannot_run() -> None:
    stages = split_model(_model(True), 0, 2, 2)  # two stages: interleaved only
    with pytest.raises(
        ValueError, match="unknown pipeline schedule 'zb'; use one of gpipe, 1f1b, interleaved"
    ):
        PipelineTrainer(stages, None, OPTIM, 1, "zb")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="schedule 1f1b runs one stage per rank, got 2"):
        PipelineTrainer(stages, None, OPTIM, 1, "1f1b")  # type: ignore[arg-type]


def test_a_model_without_the_llama_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="trainer_pp=1"):
        split_model(nn.Sequential(nn.Linear(2, 2)), 0, 2)


@pytest.mark.parametrize(
    "fields,hint",
    [
        (
            {"trainer_ranks": 4, "trainer_pp": 3},
            "trainer_ranks=4 must be divisible by trainer_pp * trainer_tp = 3 * 1",
        ),
        ({"trainer_ranks": 4, "trainer_pp": 2, "trainer_tp": 4}, "trainer_pp * trainer_tp = 2 * 4"),
        (
            {"trainer_ranks": 2, "trainer_pp": 2, "trainer_pp_schedule": "interleaved"},
            "trainer_pp_virtual >= 2",
        ),
        (
            {"trainer_ranks": 2, "trainer_pp": 2, "trainer_pp_virtual": 2},
            "needs trainer_pp_schedule=interleaved",
        ),
    ],
)
def test_runtime_config_refuses_pipeline_sizes_that_do_not_fit(fields: dict, hint: str) -> None:
    with pytest.raises(ValueError) as err:
        RuntimeConfig(backend="ray", **fields)
    assert hint in str(err.value)


def test_runtime_config_accepts_a_fitting_pipeline() -> None:
    rt = RuntimeConfig(
        backend="ray", trainer_ranks=8, trainer_pp=2, trainer_tp=2, trainer_pp_schedule="interleaved",
        trainer_pp_virtual=2,
    )  # fmt: skip
    assert (rt.trainer_pp, rt.trainer_pp_virtual) == (2, 2)


def test_a_ray_run_refuses_a_model_whose_layers_do_not_split_before_ray_starts() -> None:
    from loopline.runtime.roles import build_roles

    cfg = load_config(overrides=["runtime.backend=ray", "runtime.trainer_ranks=2", "runtime.trainer_pp=2"])
    model = build_tiny_model(TINY.model_copy(update={"num_layers": 3}), build_byte_tokenizer(), seed=0)
    with pytest.raises(ValueError, match="3 decoder layers do not divide by trainer_pp"):
        build_roles(
            cfg, model, build_byte_tokenizer()
        )  # a model.path model: the config cannot count its layers


def test_run_config_checks_the_layers_and_dpo_and_rm_refuse_a_pipeline(tmp_path: Path) -> None:
    ray = ["runtime.backend=ray", "runtime.trainer_ranks=2", "runtime.trainer_pp=2", f"out_dir={tmp_path}"]
    with pytest.raises(
        ConfigError, match=r"model.tiny.num_layers \(3\) must be divisible by runtime.trainer_pp"
    ):
        load_config(overrides=[*ray, "model.tiny.num_layers=3"])
    cfg = load_config(overrides=ray)  # train and sft run the actor through the pipeline
    check_run(cfg, "train")
    for command in ("dpo", "rm"):
        with pytest.raises(ConfigError, match=f"`loopline {command}` does not run through the pipeline yet"):
            check_run(cfg, command)
    with pytest.raises(
        ConfigError, match="backend 'local' runs one rank per role; actor=2 needs backend=ray"
    ):
        load_config(overrides=["runtime.trainer_ranks=2", "runtime.trainer_pp=2"])
