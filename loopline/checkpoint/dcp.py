"""A trainer's state as torch.distributed.checkpoint (DCP) shards: model, optimizer, LR schedule.

Every trainer rank writes its own shards (`__<rank>_0.distcp`) and rank 0 the shared `.metadata`; on
the local backend that is one rank and no process group. DCP records each tensor's global shape and
offsets, so a checkpoint written by N ranks loads into M ranks (resharding) or into one process
(`loopline export`). A rank may also write the whole weights as a Hugging Face `model.safetensors`.

An asynchronous save copies the state first (that copy is what gets written), then writes it in a
thread: the caller may update the weights at once. Every rank keeps at most one save in flight.
"""

from __future__ import annotations

import json
import struct
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from loopline.checkpoint.faults import FAULTS

if TYPE_CHECKING:
    from loopline.training.pipeline import PipelineTrainer
    from loopline.training.policy import PolicyTrainer


@contextmanager
def _quiet() -> Iterator[None]:
    # without a process group DCP warns that it assumes one process: that is the local backend's intent
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        yield


# Optimizer state keyed by parameter name throughout ("state.<name>.exp_avg", "param_groups.<name>.lr"): pipeline
# ranks hold different parameters, and a nested state's param_groups lists would collide between them.
_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)


def shard_state(model: nn.Module, trainer: PolicyTrainer | PipelineTrainer | None) -> dict[str, Any]:
    """What DCP saves: this rank's model shards and, with a trainer, its optimizer state and LR schedule.

    `model` names the parameters as the whole model does (a pipelined rank passes its `StageParts`), so a
    checkpoint loads into any pp, dp and tp."""
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if trainer is not None:
        state["optim"] = get_optimizer_state_dict(model, trainer.optimizer, options=_OPTIM)
        state["scheduler"] = trainer.scheduler.state_dict()
    return state


def load_shards(
    path: str | Path,
    model: nn.Module,
    trainer: PolicyTrainer | PipelineTrainer | None = None,
    group: dist.ProcessGroup | None = None,
    optim_aliases: Mapping[str, str] | None = None,
) -> None:
    """Load a DCP checkpoint into `model` (this rank's shards) and, when given, `trainer`'s optimizer and LR schedule.

    `group`: the trainer ranks' process group (None on the local backend); every rank of it must call this.
    `optim_aliases`: parameter name -> the name whose optimizer state it reads (a pipeline's last stage holds a
    copy of tied embeddings as lm_head.weight; an unpipelined checkpoint has their state under the embeddings').
    """
    state = shard_state(model, trainer)  # the layout to load into: DCP reshards to it
    aliases = dict(optim_aliases or {})
    if trainer is not None:
        state["optim"] = _renamed(state["optim"], aliases)
    with _quiet():
        dcp.load(state, checkpoint_id=str(path), process_group=group, no_dist=group is None)
    set_model_state_dict(model, state["model"])
    if trainer is not None:
        optim = _renamed(state["optim"], {v: k for k, v in aliases.items()})
        set_optimizer_state_dict(model, trainer.optimizer, optim, options=_OPTIM)
        trainer.scheduler.load_state_dict(state["scheduler"])


def local_state(model: nn.Module, trainer: PolicyTrainer | PipelineTrainer | None) -> dict[str, Any]:
    """This rank's `shard_state` as plain tensors (each DTensor's local part), for a rank at the same mesh position
    of another replica to load (`load_local_state`): a healthy replica's shards, not a checkpoint's."""
    from torch.distributed.tensor import DTensor

    def local(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: local(v) for k, v in value.items()}
        return value.to_local().clone() if isinstance(value, DTensor) else value

    return local(shard_state(model, trainer))


def state_digest(state: Mapping[str, Any]) -> str:
    """sha256 of a (nested) state of tensors and plain values, by key order: equal states, equal digests."""
    import hashlib

    digest = hashlib.sha256()

    def add(value: Any) -> None:
        if isinstance(value, Mapping):
            for key in sorted(value):
                digest.update(str(key).encode())
                add(value[key])
        elif isinstance(value, torch.Tensor):
            digest.update(f"{value.dtype}{tuple(value.shape)}".encode())
            digest.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(value).encode())

    add(state)
    return digest.hexdigest()


def load_local_state(
    model: nn.Module, trainer: PolicyTrainer | PipelineTrainer | None, state: Mapping[str, Any]
) -> None:
    """Load a `local_state` taken at this rank's mesh position (same layout, another replica) into `model` and
    `trainer`: the shapes must match exactly, since nothing is resharded."""
    from torch.distributed.tensor import DTensor

    target = shard_state(
        model, trainer
    )  # this rank's DTensors to fill (a fresh optimizer's state is created)

    def fill(into: dict[str, Any], values: Mapping[str, Any], where: str) -> None:
        if into.keys() != values.keys():
            missing, extra = sorted(into.keys() - values.keys()), sorted(values.keys() - into.keys())
            raise ValueError(
                f"replica state for {where} does not match this rank's: missing {missing[:3]}, extra {extra[:3]}"
            )
        for key, value in values.items():
            if isinstance(into[key], dict):
                fill(into[key], value, f"{where}.{key}")
            elif isinstance(into[key], DTensor):
                part = into[key].to_local()
                if part.shape != value.shape:
                    raise ValueError(
                        f"replica state {where}.{key}: shape {tuple(value.shape)}, this rank holds {tuple(part.shape)}"
                    )
                part.copy_(value)
            else:
                into[key] = value.clone() if isinstance(value, torch.Tensor) else value

    fill(target, state, "state")
    set_model_state_dict(model, target["model"])
    if trainer is not None:
        set_optimizer_state_dict(model, trainer.optimizer, target["optim"], options=_OPTIM)
        trainer.scheduler.load_state_dict(target["scheduler"])


def _renamed(optim: dict[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """A flattened optimizer state ("state.<param>.<key>", "param_groups.<param>.<key>") with params renamed."""
    if not names:
        return optim
    out = {}
    for key, value in optim.items():
        head, _, rest = key.partition(".")
        for old, new in names.items():
            if rest.startswith(old + "."):
                key = f"{head}.{new}{rest[len(old) :]}"
                break
        out[key] = value
    return out


def tied_aliases(model: nn.Module) -> set[str]:
    """Names of parameters that are another parameter (tied embeddings): saved once, under the first name."""
    seen: set[int] = set()
    aliases = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases.add(name)
        seen.add(id(param))
    return aliases


SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


def write_hf_weights(model: nn.Module, weights: Mapping[str, torch.Tensor], directory: str | Path) -> None:
    """`weights` (whole tensors) as DIRECTORY/model.safetensors, tied aliases left out, as transformers saves them.

    Written one tensor at a time, so a mapping that makes its tensors when read (a LoRA model's MergedWeights)
    holds one of them beside the model, not a merged copy of the whole model (gigabytes at 1.5B parameters): the
    header (each tensor's dtype, shape and byte range) first, from a pass that reads each tensor and drops it."""
    aliases = tied_aliases(model)
    names = [k for k in weights if k not in aliases]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        t = weights[name]
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    Path(directory).mkdir(parents=True, exist_ok=True)
    with open(Path(directory) / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for name in names:
            tensor = weights[name].detach().to("cpu").contiguous().reshape(-1)
            f.write(tensor.view(torch.uint8).numpy().data)  # its bytes, little-endian (x86, ARM)


def copy_state(value: Any) -> Any:
    """A deep copy of a state tree; tensors are cloned (to CPU memory where they are not there already)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: copy_state(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(copy_state(v) for v in value)
    return value


def checkpoint_of(path: str | Path) -> str:
    """The checkpoint a rank's DCP path belongs to: <name> of <root>/.tmp-<name>/dcp (the fault points' names)."""
    return Path(path).parent.name.removeprefix(".tmp-")


class ShardWriter:
    """Writes one rank's part of a checkpoint: DCP shards and, optionally, the whole weights as safetensors."""

    def __init__(self, timeout_s: float = 600.0) -> None:
        """timeout_s: the longest a save waits for the one before it to be written."""
        self.timeout_s = timeout_s
        self.checkpoint = ""  # the checkpoint of the last save (checkpoint_of its path)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(
        self,
        path: str | Path,
        state: dict[str, Any],
        group: dist.ProcessGroup | None = None,
        hf: tuple[nn.Module, Mapping[str, torch.Tensor], str] | None = None,
        blocking: bool = True,
        extra: Sequence[tuple[str | Path, dict[str, Any]]] = (),
    ) -> None:
        """Write `state` (from shard_state) to `path` with DCP, then `hf` = (model, whole weights, dir) if given,
        then each (path, state) of `extra` as a DCP checkpoint of its own (e.g. the frozen reference).

        blocking=False: copy `state` and the weights now, write them in a thread; wait() for it to end.
        An async save needs `group` to be a process group used by nothing else while it runs (its collectives
        run in the thread).
        """
        self.wait(self.timeout_s)  # at most one save in flight
        self.checkpoint = checkpoint_of(path)
        if blocking:
            self._write(path, state, group, hf, extra)
            return
        staged = copy_state(state)
        staged_hf = None
        if hf is not None:  # unsharded, the whole weights are the model part of `state`: copy them once
            weights = staged["model"] if hf[1] is state["model"] else copy_state(dict(hf[1]))
            staged_hf = (hf[0], weights, hf[2])
        staged_extra = [(p, copy_state(s)) for p, s in extra]
        self._error = None
        self._thread = threading.Thread(
            target=self._write_catching,
            args=(path, staged, group, staged_hf, staged_extra),
            name="checkpoint-writer",
            daemon=True,
        )
        self._thread.start()

    def wait(self, timeout_s: float | None) -> None:
        """Block until the save in flight (if any) is written; raise its error, or TimeoutError after timeout_s."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                raise TimeoutError(f"checkpoint write did not finish within {timeout_s:g}s")
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"checkpoint write failed: {type(error).__name__}: {error}") from error

    def _write_catching(self, *args: Any) -> None:
        try:
            self._write(*args)
        except BaseException as e:  # reported by wait() in the caller's thread
            self._error = e

    @staticmethod
    def _write(
        path: str | Path,
        state: dict[str, Any],
        group: dist.ProcessGroup | None,
        hf: tuple[nn.Module, Mapping[str, torch.Tensor], str] | None,
        extra: Sequence[tuple[str | Path, dict[str, Any]]] = (),
    ) -> None:
        with _quiet():
            dcp.save(state, checkpoint_id=str(path), process_group=group, no_dist=group is None)
        # test hook: a kill half-way
        FAULTS.pause_point(f"save:mid:{checkpoint_of(path)}")
        if hf is not None:
            write_hf_weights(*hf)
        for extra_path, extra_state in extra:
            with _quiet():
                dcp.save(
                    extra_state, checkpoint_id=str(extra_path), process_group=group, no_dist=group is None
                )


def read_full_state(path: str | Path) -> dict[str, Any]:
    """The whole of a DCP checkpoint in this process, without a model to load into: whole tensors."""
    # private, but the one DCP loader that needs no template; format_utils.dcp_to_torch_save wraps it
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with _quiet():
        return _load_state_dict_from_keys(checkpoint_id=str(path))


def read_model_weights(path: str | Path, model: nn.Module) -> None:
    """Load the model part of a DCP checkpoint (written by any number of ranks) into one unsharded `model`."""
    state = {"model": get_model_state_dict(model)}
    with _quiet():
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    set_model_state_dict(model, state["model"])
