"""Checkpoints through ``torch.distributed.checkpoint`` (DCP) for hvd_scale's torch.distributed
optimizers (FSDP2's and DDP's): torch's state_dict functions with the run's record beside the
inner optimizer's state.

    from hvd_scale.adapters.torch.dcp import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)               # sharded (DTensor) state
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    ...
    model_sd, optim_sd = get_state_dict(model, opt)               # the templates to load into
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)                            # any world size
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

Each function takes and returns what torch's function of the same name
(``torch.distributed.checkpoint.state_dict``) does, for the optimizer that hvd_scale wraps, plus
one key, ``"hvd_scale"``: the run's record (``DistributedOptimizer.state_dict()["hvd_scale"]``:
the policy's state, tau, the estimates, S, k, the workers) and the guard's estimate, as one JSON
text. One text, not a nested dict: DCP flattens dicts into keys and loads only the keys its
template has, so a template of another shape could keep a fresh record's values unnoticed; a text
is one key, loaded whole or refused. The record is the same on every rank (the optimizer checks
it), so DCP writes it once; it loads at any world size and layout, where the optimizer's own
``load_state_dict`` takes it as it takes any checkpoint's (``hvd_scale.run.restored``: tau, the
estimates and the policy's state continue; S follows this job's workers).

torch's functions key the optimizer's state by parameter name, the same under FSDP2 and DDP (DDP's
``module.`` prefix is dropped): a checkpoint saved under one engine loads under the other.

Never pass hvd_scale's optimizer to torch's functions directly: they make a fresh optimizer's
state by calling its ``step()`` on zero gradients, which hvd_scale would count as a step; here
the wrapped optimizer takes that step (at lr 0, as under plain FSDP2).
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict as _torch

from .optimizer import TorchOptimizer

__all__ = ["RECORD", "get_optimizer_state_dict", "set_optimizer_state_dict", "get_state_dict",
           "set_state_dict"]

RECORD = "hvd_scale"  # the key of the run's record in the optimizer's state dict


def _checked(optimizer) -> TorchOptimizer:
    if isinstance(optimizer, (list, tuple)):
        if len(optimizer) != 1:
            raise ValueError(f"hvd_scale's DCP functions take one hvd_scale optimizer, got "
                             f"{len(optimizer)}")
        optimizer = optimizer[0]
    if not isinstance(optimizer, TorchOptimizer):
        raise TypeError(f"expected hvd_scale's DistributedOptimizer (FSDP2's or DDP's), got "
                        f"{type(optimizer).__name__}: for a plain torch optimizer use "
                        "torch.distributed.checkpoint.state_dict's functions")
    return optimizer


def _inner(optimizer: TorchOptimizer) -> torch.optim.Optimizer:
    return optimizer._inner  # the wrapped torch optimizer: its state_dict is the one saved


def _record_text(optimizer: TorchOptimizer) -> str:
    own = optimizer.state_dict()
    record = {key: own[key] for key in own if key != "inner"}  # the run's record, the guard's
    return json.dumps(record, allow_nan=True)  # nan: last_lr before any step


def get_optimizer_state_dict(model: torch.nn.Module, optimizers, *, submodules=None,
                             options: _torch.StateDictOptions | None = None) -> dict:
    """torch's ``get_optimizer_state_dict`` of the wrapped optimizer, and ``"hvd_scale"``: the
    run's record as JSON text (on every rank, also where torch's part is empty: a full state
    dict with ``cpu_offload`` is rank 0's)."""
    optimizer = _checked(optimizers)
    state = _torch.get_optimizer_state_dict(model, _inner(optimizer), submodules=submodules,
                                            options=options)
    state[RECORD] = _record_text(optimizer)
    return state


def _record_on_every_rank(record, options) -> str:
    """The record each rank loads: rank 0's where the options broadcast from it; refused on
    every rank (no hang) where some rank has none."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        found = [record]
    elif options is not None and options.broadcast_from_rank0:
        found = [record if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(found, src=0)
    else:
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, record)
    missing = [rank for rank, r in enumerate(found) if not isinstance(r, str)]
    if missing:
        raise ValueError(
            f"hvd_scale: the optimizer state dict has no {RECORD!r} record (a JSON text) on "
            f"rank(s) {missing}: it was not saved by hvd_scale.adapters.torch.dcp's "
            "get_optimizer_state_dict / get_state_dict, or the template given to dcp.load "
            "lacked the key. Nothing was loaded")
    return found[0] if len(found) == 1 or options and options.broadcast_from_rank0 \
        else found[dist.get_rank()]


def _validated(optimizer: TorchOptimizer, optim_state_dict: dict, options) -> tuple[dict, dict]:
    """(the record, torch's part of the state dict); a record that does not fit this optimizer
    is refused on every rank before anything is loaded."""
    state = dict(optim_state_dict)
    text = _record_on_every_rank(state.pop(RECORD, None), options)
    try:
        record = json.loads(text)
        if not isinstance(record, dict) or "hvd_scale" not in record:
            raise ValueError(f"keys {sorted(record) if isinstance(record, dict) else record!r}")
        optimizer.scaling.restored(record["hvd_scale"])  # validated; nothing changes
    except ValueError as e:
        raise ValueError(f"hvd_scale: the checkpoint's {RECORD!r} record does not fit this "
                         f"optimizer ({e}). Nothing was loaded") from e
    return record, state


def _load(model, optimizer: TorchOptimizer, record: dict, state: dict, options) -> None:
    inner = _inner(optimizer)
    _torch.set_optimizer_state_dict(model, inner, state, options=options)
    # The wrapper's load shares the inner optimizer's new groups and state again.
    optimizer.load_state_dict({**record, "inner": inner.state_dict()})


def set_optimizer_state_dict(model: torch.nn.Module, optimizers, optim_state_dict: dict, *,
                             options: _torch.StateDictOptions | None = None) -> None:
    """torch's ``set_optimizer_state_dict`` on the wrapped optimizer, then the run's record
    through the optimizer's ``load_state_dict`` (validated first: a bad record changes nothing).
    With ``broadcast_from_rank0`` only rank 0 needs the record."""
    optimizer = _checked(optimizers)
    record, state = _validated(optimizer, optim_state_dict, options)
    _load(model, optimizer, record, state, options)


def get_state_dict(model: torch.nn.Module, optimizers, *, submodules=None,
                   options: _torch.StateDictOptions | None = None) -> tuple[dict, dict]:
    """``(model state dict, optimizer state dict)``: torch's ``get_model_state_dict`` and this
    module's ``get_optimizer_state_dict``."""
    return (_torch.get_model_state_dict(model, submodules=submodules, options=options),
            get_optimizer_state_dict(model, optimizers, submodules=submodules, options=options))


def set_state_dict(model: torch.nn.Module, optimizers, *, model_state_dict: dict,
                   optim_state_dict: dict, options: _torch.StateDictOptions | None = None):
    """The model's state (torch's ``set_model_state_dict``), then the optimizer's and the run's
    (``set_optimizer_state_dict``). Returns the model's missing and unexpected keys, as torch's."""
    optimizer = _checked(optimizers)
    record, state = _validated(optimizer, optim_state_dict, options)  # before the model's
    keys = _torch.set_model_state_dict(model, model_state_dict, options=options)
    _load(model, optimizer, record, state, options)
    return keys

