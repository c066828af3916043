"""A vLLM engine behind the same interface as TorchEngine (rollout.engine=vllm).

vLLM runs in this process (its engine core in-process, VLLM_ENABLE_V1_MULTIPROCESSING=0), so the weight sync
and generate reach it without pickling. `model` is a Hugging Face copy of the policy that the weight sync writes
into, as it writes into TorchEngine's model (same transfer plan, same names); `commit_weights` then loads those
tensors into the running vLLM (its reload_weights: fused and repacked as vLLM lays them out, no restart) and
drops its prefix cache, whose keys and values the old weights computed.

Sampling is reproducible: each prompt's request carries a seed drawn from the engine's generator (or the
process's torch RNG when built without `seed`), so a checkpointed generator state repeats the same samples.

One engine per process: vLLM's parallel state is global to a process, and stopping one engine tears it down
for any other (the local backend runs one engine, each Ray engine rank is its own process).

Simplified: the HF copy is a second set of weights beside vLLM's own (host memory on CPU; on a GPU it stays
where the model was put); no partial rollouts (weights load between generate calls only); TP=1.
"""

from __future__ import annotations

import logging
import os
import tempfile
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from loopline.rollout.config import VLLM_INSTALL_HINT, VllmConfig
from loopline.rollout.engine import Completion, SamplingParams


def import_vllm() -> Any:
    """The vllm module, imported in-process (engine core in this process); a clear error if it is missing."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # not a page of start-up lines per engine
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is for `generate`'s JSON lines
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{VLLM_INSTALL_HINT} ({e})") from e
    return vllm


def _refresh_tied_head(model: torch.nn.Module) -> None:
    """A tied LM head after a reload: vLLM's CPU backend packs the head's weight into a copy for its GEMM,
    which its reload leaves stale (it logs "ParallelLMHead: Failed to load weights"), so the head would go on
    scoring with the old embedding; packed again here from the reloaded one (a no-op where nothing is packed)."""
    head = model.lm_head  # type: ignore[union-attr]
    head.quant_method.process_weights_after_loading(head)


_LIVE: weakref.WeakSet[VllmEngine] = weakref.WeakSet()  # the engines of this process (at most one runs)


class VllmEngine:
    """vLLM's LLM on a copy of `model`, with TorchEngine's methods: generate, update_weights, the weight
    sync's receiving `model` and `commit_weights`, and the sampling generator's state for checkpoints."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        cfg: VllmConfig | None = None,
        seed: int | None = None,
        max_rows: int = 0,
    ) -> None:
        """seed: the generator each request's seed comes from (None: the process's torch RNG); max_rows:
        vLLM's max_num_seqs (0: vLLM's default)."""
        cfg = cfg or VllmConfig()
        if any(e._llm is not None for e in _LIVE):
            raise RuntimeError(
                "a vLLM engine already runs in this process: vLLM keeps its parallel state per process, so a "
                "second one would break the first when either stops (close() the first one)"
            )
        vllm = import_vllm()
        if cfg.sleep and not torch.cuda.is_available():
            raise ValueError("rollout.vllm.sleep=true needs a GPU (vLLM's sleep mode frees CUDA memory)")
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.version = 0
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)
        extra: dict[str, Any] = {"max_num_seqs": max_rows} if max_rows else {}
        if cfg.max_model_len:
            extra["max_model_len"] = cfg.max_model_len
        if not torch.cuda.is_available():  # a fixed KV cache: vLLM's estimate from memory_fraction subtracts
            # this process's whole resident memory, which a trainer in the same process can exceed
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.cpu_kv_cache_gib)
        # vLLM's CPU worker pins torch to one thread and then disables torch.set_num_threads for the whole
        # process; the trainer may share this process, so both are put back once the engine is up, and each
        # call into vLLM runs at vLLM's own count (its attention kernels check it against their metadata's)
        set_threads, threads = torch.set_num_threads, torch.get_num_threads()
        # vLLM starts from a checkpoint directory, read only while it starts: the model as it is now
        try:
            with tempfile.TemporaryDirectory(prefix="loopline-vllm-") as start:
                model.save_pretrained(start)
                tokenizer.save_pretrained(start)
                self._llm = vllm.LLM(
                    model=start,
                    dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
                    seed=0 if seed is None else seed,
                    gpu_memory_utilization=cfg.memory_fraction,
                    enforce_eager=cfg.enforce_eager,
                    enable_sleep_mode=cfg.sleep,
                    logprobs_mode="processed_logprobs",  # after temperature and top-k/p, as the trainer scores
                    **extra,
                )
            self._threads = torch.get_num_threads()  # what vLLM set for serving
        finally:
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)
        # each reload warns "Failed to load weights" for the rotary embedding (no weights) and the tied head
        # (repacked by commit_weights): both expected, so only that module's errors (set after LLM(), whose
        # logging config resets the levels of vLLM's loggers)
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        self._vllm = vllm
        self._asleep = False
        _LIVE.add(self)
        if cfg.sleep:
            self._sleep()

    # -----------------------------------------------------------------------------------------------------
    # Generation
    # -----------------------------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> list[Completion]:
        """n completions per prompt (token ids, no padding), each token with its log-prob under the
        distribution it was sampled from."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs non-empty prompts")
        gen = self.generator if params.seed is None else torch.Generator().manual_seed(params.seed)
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),), generator=gen).tolist()
        requests = [
            self._vllm.SamplingParams(
                n=n,
                max_tokens=params.max_new_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else -1,
                stop=list(params.stop),
                include_stop_str_in_output=True,  # as TorchEngine: the stop string ends the completion
                logprobs=0,  # the sampled token's own log-prob
                seed=s,
                ignore_eos=params.ignore_eos,
            )
            for s in seeds
        ]
        self._wake()
        try:
            with self._serving_threads():
                outputs = self._llm.generate(
                    [self._vllm.TokensPrompt(prompt_token_ids=p) for p in prompts], requests, use_tqdm=False
                )
        finally:
            if self.cfg.sleep:
                self._sleep()
        completions = []
        for i, out in enumerate(outputs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                if c.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM ended prompt {i}'s sample {c.index} with '{c.finish_reason}'")
                completions.append(
                    Completion(
                        prompt_index=i,
                        sample_index=c.index,
                        token_ids=ids,
                        logprobs=[lp[t].logprob for t, lp in zip(ids, c.logprobs or [])],
                        text=self.tokenizer.decode(ids, skip_special_tokens=True),
                        finish_reason=c.finish_reason,
                        policy_version=self.version,
                        token_versions=[self.version] * len(ids),
                    )
                )
        return completions

    # -----------------------------------------------------------------------------------------------------
    # Weights
    # -----------------------------------------------------------------------------------------------------

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy new weights (the HF model's names) into `model`, then into vLLM."""
        params = self.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in state_dict.items():
                if name not in params:
                    raise KeyError(f"engine model has no parameter '{name}'")
                params[name].copy_(tensor)
        self.commit_weights(version)

    def commit_weights(self, version: int) -> None:
        """`model` holds weights `version` (a sync wrote them): load them into the running vLLM."""
        if self._asleep:
            self._llm.wake_up(tags=["weights"])
        weights = [(n, p.detach()) for n, p in self.model.named_parameters()]
        with self._serving_threads():
            self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            if getattr(self.model.config, "tie_word_embeddings", False):
                self._llm.apply_model(_refresh_tied_head)
        self._llm.reset_prefix_cache()  # its keys and values came from the old weights
        self.version = version

    # -----------------------------------------------------------------------------------------------------
    # Sampling state (checkpoints), sleep, shutdown
    # -----------------------------------------------------------------------------------------------------

    def rng_state(self) -> torch.Tensor | None:
        """The generator the requests' seeds come from (a copy), or None when they come from the process's RNG."""
        return None if self.generator is None else self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        if self.generator is None:
            raise ValueError("this engine seeds from the process's torch RNG: it has no generator to restore")
        self.generator.set_state(state)

    def reseed(self, seed: int) -> None:
        if self.generator is None:
            raise ValueError("this engine seeds from the process's torch RNG: it has no generator to reseed")
        self.generator.manual_seed(seed)

    @contextmanager
    def _serving_threads(self) -> Iterator[None]:
        """This thread at vLLM's thread count while it runs vLLM (a Ray actor's calls come on several threads,
        each with its own OpenMP count); the caller's count back after."""
        before = torch.get_num_threads()
        torch.set_num_threads(self._threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _sleep(self) -> None:
        self._llm.sleep(level=1)
        self._asleep = True

    def _wake(self) -> None:
        if self._asleep:
            self._llm.wake_up()
            self._asleep = False

    def close(self) -> None:
        """Stop vLLM's engine core (its memory is freed once nothing refers to the engine)."""
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is not None:
            core = getattr(llm.llm_engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
