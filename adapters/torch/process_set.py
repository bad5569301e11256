"""``core.Scaling``'s collectives (``protocol.HorovodBinding``) within one Horovod process set."""

from __future__ import annotations

import pickle

import horovod.torch as hvd
import torch


class ProcessSetBinding:
    """``core.Scaling``'s collectives within one Horovod process set (the whole job by default)."""

    def __init__(self, process_set):
        self.process_set = process_set
        self._global = process_set is hvd.global_process_set

    def size(self) -> int:
        return hvd.size() if self._global else self.process_set.size()

    def rank(self) -> int:
        return hvd.rank() if self._global else self.process_set.rank()

    def allgather_object(self, obj, name=None) -> list:
        if self._global:
            return hvd.allgather_object(obj, name=name)
        # Horovod's allgather_object has no process set: pickles of any length, gathered.
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = hvd.allgather(torch.tensor([data.numel()]), name=f"{name}.sizes",
                              process_set=self.process_set)
        gathered = hvd.allgather(data, name=name, process_set=self.process_set)
        return [pickle.loads(chunk.numpy().tobytes())
                for chunk in torch.split(gathered, sizes.tolist())]

    def broadcast_object(self, obj, root_rank=0, name=None):
        return hvd.broadcast_object(obj, root_rank=root_rank, name=name,
                                    process_set=self.process_set)
