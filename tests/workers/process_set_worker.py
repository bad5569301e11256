"""Run under horovodrun -np 2: two process sets of one worker each, each training on its own
(k = 2, adascale): S, n and the statistics must be the set's, as a one-process reference has them."""

import horovod.torch as hvd
import torch

from _report import emit_result
from hvd_scale import GainEstimator
from hvd_scale.adapters.torch import DistributedOptimizer

K = 2


def main():
    sets = [hvd.ProcessSet([0]), hvd.ProcessSet([1])]
    hvd.init(process_sets=sets)
    mine = sets[hvd.rank()]
    torch.manual_seed(hvd.rank())  # each set its own model
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    w0 = [p.detach().clone() for p in model.parameters()]
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(), policy="adascale",
                               backward_passes_per_step=K, process_set=mine)
    ref, gains, ref_gains = GainEstimator(scale=K), [], []
    for step in range(4):
        opt.zero_grad()
        micro = []
        for j in range(K):
            g = torch.Generator().manual_seed(100 * step + 10 * hvd.rank() + j)
            x = torch.randn(16, 6, generator=g, dtype=torch.float64)
            loss = torch.nn.functional.cross_entropy(model(x), (x[:, :3]).argmax(1))
            loss.backward()
            total = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            micro.append(total - sum(micro, torch.zeros_like(total)))
        opt.step()
        mean = torch.stack(micro).mean(0)
        ref_gains.append(ref.update(float(sum(m @ m for m in micro)), float(mean @ mean), K))
        gains.append(opt.gain)
    # The sets share no collective: keep both processes in the job until both are done (a worker
    # that exits first shuts Horovod down under the other, whose set then reads "not registered").
    hvd.allreduce(torch.zeros(1), name="both_done")
    emit_result(rank=hvd.rank(), scale=opt.scale, gains=gains, ref_gains=ref_gains,
                sigma2=opt.sigma2, ref_sigma2=ref.sigma2,
                moved=float(sum((p.detach() - w).abs().sum() for p, w in zip(model.parameters(), w0))))


if __name__ == "__main__":
    main()
