"""Every key a run writes to metrics.jsonl, with what it means: the one declaration of the metrics rows.

The loops build their rows where the values are (loops/sft.py, loops/grpo.py, loops/preference.py); this table
says what each key is, docs/reference/metrics.md is generated from it (scripts/gen_docs.py), and
tests/metrics/test_keys.py runs a short `loopline train` and checks that every key it writes is declared here.
Keys whose names carry a part chosen at run time (a stage, a role, an env's info key) are declared as patterns
with the part in angle brackets.
"""

from __future__ import annotations

import re

# Every row
ROW = {
    "phase": "Which phase wrote the row: sft, grpo, dpo or rm.",
    "step": "Optimizer steps taken in the phase so far (0: the evaluation before its first step).",
}

# Rows of every training phase
TRAINING = {
    "loss": "The objective minimised in the step (SFT: token-mean NLL; GRPO family: surrogate - entropy bonus + "
    "KL term; DPO: pref_loss + dpo.nll_coef * chosen_nll; rm: the Bradley-Terry loss).",
    "grad_norm": "Gradient norm before clipping; not finite when the update was skipped.",
    "lr": "Learning rate used in the step.",
    "time_train": "Seconds in the train stage of the step (forward, backward, optimizer).",
}

# Evaluations (any phase; on the rows where an eval or a validation check ran)
EVAL = {
    "eval_accuracy": "Held-out accuracy (greedy by default): a response is correct when the env gives it a positive "
    "reward; a code completion when it passes every test.",
    "eval_response_len": "Mean response length on the held-out set, in tokens (multi-turn: the model's tokens).",
    "val_accuracy": "Accuracy on the validation split at a stop check (sft/grpo.stop_at_accuracy; the split's first "
    "sft.coarse_val problems until the check passes half the target).",
    "eval_return_mean": "Multi-turn eval: mean episode return.",
    "eval_turns_mean": "Multi-turn eval: mean turns per episode.",
    "eval_response_tokens_mean": "Multi-turn eval: mean episode length in tokens, observations included.",
    "eval_finish_done": "Multi-turn eval: fraction of episodes the env ended.",
    "eval_finish_max_turns": "Multi-turn eval: fraction of episodes cut at env.max_turns.",
    "eval_finish_max_tokens": "Multi-turn eval: fraction of episodes cut at env.max_episode_tokens.",
    "eval_finish_env_error": "Multi-turn eval: fraction of episodes an env error ended.",
    "eval_<info>": "Multi-turn eval: the mean of a numeric key the env reports in its step info (the calculator: "
    "tool_calls, tool_calls_ok, tool_error_<kind>, answered, correct).",
}

SFT = {
    "tokens_per_s": "SFT: tokens (prompt and target) trained per second in the step.",
}

GRPO = {
    "reward_mean": "GRPO: mean reward of the step's samples; rm: mean score of the chosen and rejected sides.",
    "reward_std": "GRPO: standard deviation of the step's rewards.",
    "accuracy": "GRPO: fraction of the step's samples that are correct (sampled, not greedy).",
    "policy_loss": "GRPO: the surrogate term of the loss alone.",
    "kl": "GRPO: the KL-to-reference term as aggregated in the loss (0 when grpo.kl_coef is 0).",
    "entropy": "GRPO: token mean of the policy's entropy.",
    "clip_fraction": "GRPO: token fraction whose ratio was clipped.",
    "approx_kl": "GRPO: token mean of the k3 estimate of KL(old policy || new policy).",
    "response_len_mean": "GRPO: mean response length of the step's samples, in tokens.",
    "response_len_max": "GRPO: longest response of the step, in tokens.",
    "truncated_fraction": "GRPO: fraction of samples cut at the sampling's max_new_tokens.",
    "rollout_tokens_per_s": "GRPO: response tokens generated per second of the rollout stage.",
    "train_tokens_per_s": "GRPO: tokens trained per second of the train stage (times grpo.epochs_per_step).",
    "time_rollout": "GRPO: seconds generating the step's samples.",
    "time_score": "GRPO: seconds scoring them on the env workers.",
    "time_experience": "GRPO: seconds computing log-probs, values and advantages.",
    "time_sync": "GRPO: seconds of the weight sync into the engines (and waiting for the batches due first).",
    "time_step": "GRPO: wall seconds of the whole step, evaluations excluded.",
    "score_retries": "GRPO: env-worker chunks scored again after a worker died or hung.",
    "env_workers_replaced": "GRPO: env workers replaced in the step.",
    "env_workers": "GRPO: env workers in the pool after the step (also set by `loopline scale`).",
    "kl_coef": "GRPO with grpo.kl_coef > 0: the KL coefficient used (adaptive controller: its current value).",
    "measured_kl": "GRPO with grpo.kl_coef > 0: the KL to the reference measured in the step.",
    "sampling_rounds": "DAPO dynamic sampling: generation rounds it took to fill the batch.",
    "informative_fraction": "DAPO dynamic sampling: fraction of groups with reward variance.",
    "behaviour_weight_min": "grpo.behaviour_correction: smallest trainer/engine probability ratio weight.",
    "behaviour_weight_mean": "grpo.behaviour_correction: mean weight.",
    "behaviour_weight_max": "grpo.behaviour_correction: largest weight.",
    "behaviour_cut_fraction": "grpo.behaviour_correction: fraction of tokens truncated or masked.",
    "logprob_mismatch_kl": "GRPO when the trainer's log-probs at the sampling temperature are computed "
    "(grpo.behaviour_correction, or an engine dtype (rollout.dtype) other than the trainer's compute dtype): token "
    "mean of the k3 estimate of KL(engine || trainer) over the sampled tokens; 0 when both compute the same.",
    "logprob_mismatch_max_abs": "GRPO, as logprob_mismatch_kl: the largest |trainer - engine| log-prob of a "
    "sampled token.",
    "value_loss": "PPO (grpo.advantage=gae): the critic's clipped value loss.",
    "value_grad_norm": "PPO: the critic's gradient norm before clipping.",
    "value_clip_fraction": "PPO: token fraction where the clipped value error was the larger.",
    "value_mean": "PPO: the critic's mean value over response tokens.",
    "staleness_mean": "Async RL (grpo.max_staleness=k): mean policy versions between a sample's weights and "
    "the trained ones.",
    "staleness_max": "Async RL: the largest such gap in the batch.",
    "staleness_<v>": "Async RL: fraction of the batch exactly v versions stale (v = 0 .. k).",
    "partial_fraction": "Async RL with grpo.partial_rollouts: fraction of samples whose tokens come from two or "
    "more policy versions.",
    "time_wait": "Async RL: seconds the trainer waited for a batch or for the engines.",
    "trainer_idle_fraction": "Async RL: time_wait over the step's wall time.",
    "engine_idle_fraction": "Async RL: fraction of the step the engines had nothing to generate.",
    "stale_dropped": "Async RL: samples dropped for being past the staleness bound (only after a resume with a "
    "smaller k).",
    "episode_return_mean": "Multi-turn: mean episode return.",
    "episode_turns_mean": "Multi-turn: mean turns per episode.",
    "episode_model_tokens_mean": "Multi-turn: mean model tokens per episode (the trained ones).",
    "episode_response_tokens_mean": "Multi-turn: mean episode length in tokens, observations included.",
    "episode_finish_done": "Multi-turn: fraction of episodes the env ended.",
    "episode_finish_max_turns": "Multi-turn: fraction cut at env.max_turns.",
    "episode_finish_max_tokens": "Multi-turn: fraction cut at env.max_episode_tokens.",
    "episode_finish_env_error": "Multi-turn: fraction an env error ended.",
    "episode_<info>": "Multi-turn: the mean of a numeric key the env reports in its step info (the calculator: "
    "tool_calls, tool_calls_ok, tool_error_<kind>, answered, correct; openai_agent: sequences).",
}

PREFERENCE = {
    "pref_loss": "DPO: the dpo.loss term alone.",
    "chosen_nll": "DPO: per-token NLL of the chosen completion (the anchor weighted by dpo.nll_coef).",
    "pref_accuracy": "DPO: fraction of pairs whose implicit reward ranks chosen above rejected.",
    "reward_margin": "DPO: implicit reward of chosen minus rejected; rm: score of chosen minus rejected.",
    "chosen_reward": "DPO: implicit reward beta * (log p - log p_ref) of the chosen completion.",
    "rejected_reward": "DPO: the same of the rejected completion.",
    "pair_accuracy": "rm: fraction of training pairs scored chosen > rejected (a tie counts half).",
    "eval_pref_accuracy": "DPO: pref_accuracy on the held-out pairs.",
    "eval_reward_margin": "DPO and rm: reward_margin on the held-out pairs.",
    "eval_logp_accuracy": "DPO: fraction of held-out pairs where the policy gives chosen the higher log-prob.",
    "eval_pair_accuracy": "rm: pair_accuracy on the held-out pairs.",
}

# Rows of every training phase of a mixture-of-experts policy (loopline.training.router)
ROUTER = {
    "router_cv": "MoE policy: coefficient of variation (std / mean over the experts) of the tokens each expert got "
    "in the step (top-k assignments of the training forwards' real tokens, all ranks), averaged over the MoE "
    "layers; 0 = perfectly balanced, sqrt(experts - 1) = every token on the same experts.",
    "router_cv_layer<l>": "MoE policy: router_cv of the router of decoder layer l alone.",
    "router_aux_loss": "MoE policy: the Switch Transformer load-balancing loss over the step's tokens, pooled over "
    "the layers as transformers defines it (experts per token at perfect balance); each micro-batch's own is "
    "added to its objective times model.router_aux_loss_coef (not counted in loss).",
    "router_aux_loss_layer<l>": "MoE policy: the load-balancing loss of decoder layer l's router alone.",
    "route_mismatch": "MoE policy, GRPO family, built-in engine: share of the (token, MoE layer) pairs of the step's "
    "training forwards whose top-k experts (as a set) the trainer's router chose differently from the engine's "
    "(with grpo.routing_replay=true the engine's were used instead).",
}

# Noted once, on the next row after the event
EVENTS = {
    "data_skipped_rows": "Data rows skipped at load (data.skip_bad_rows, data.overlong=skip), on the first row.",
    "data_skipped_<reason>": "The same, per reason.",
    "recover_<role>_s": "Seconds a recovery of role <role> took (restart from a checkpoint; env: a worker's "
    "replacement), on the first row after it.",
    "heal_actor_s": "Seconds spent healing the trainer from a live replica (runtime.trainer_replicas >= 2), "
    "summed over the step.",
    "heals": "Heals of the trainer in the step.",
    "engines": "Rollout engines after a `loopline scale` request was applied.",
    "scale_s": "Seconds a `loopline scale` request took to apply.",
}

SECTIONS: dict[str, dict[str, str]] = {
    "Every row": ROW,
    "Training steps (every phase)": TRAINING,
    "Evaluation": EVAL,
    "SFT": SFT,
    "GRPO family (GRPO, PPO, DAPO, async RL, multi-turn)": GRPO,
    "DPO and reward models": PREFERENCE,
    "Mixture-of-experts routers (SFT, GRPO family, DPO)": ROUTER,
    "Events (noted on the next row)": EVENTS,
}

METRICS: dict[str, str] = {key: text for section in SECTIONS.values() for key, text in section.items()}

_PATTERNS = [
    (re.compile("^" + re.sub(r"<[a-z]+>", ".+", re.escape(key)) + "$"), key) for key in METRICS if "<" in key
]


def declared(key: str) -> str | None:
    """The declaration `key` matches (itself, or a pattern such as 'staleness_<v>'), or None if undeclared."""
    if key in METRICS:
        return key
    return next((name for pattern, name in _PATTERNS if pattern.match(key)), None)
