"""Train a small model over 2 pipeline ranks:  mpiexec -n 2 python examples/pipeline_demo.py"""

import torch
import torch.nn.functional as F
from mpi4py import MPI
from smp_comm import Communicator
from smp_pipeline import PipelineRuntime
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)], nn.Linear(16, 1))
comm = Communicator(MPI.COMM_WORLD)
rt = PipelineRuntime(
    model, comm, pp_rank=comm.rank, pp_size=comm.size,
    assignment={"2": 1, "3": 1, "4": 1},  # or None: trace + smp_partition on the first step
    schedule="interleaved", timeline=True,
)
opt = torch.optim.SGD(rt.local_parameters(), lr=0.05)  # only this rank's parameters
x, y = torch.randn(32, 16), torch.randn(32, 1)


def train_step(x, y):  # runs on pp rank 0, once per microbatch
    loss = F.mse_loss(model(x), y)
    rt.backward(loss)  # scaled by 1/num_microbatches
    return loss


for step in range(5):
    losses = rt.run_step(train_step, (x, y), num_microbatches=4)  # every rank calls it
    opt.step()
    opt.zero_grad()
    if comm.rank == 0:
        print(f"step {step}: loss {torch.stack(losses).mean().item():.4f}")
rt.write_timeline("timeline.json")  # collective; add png_path="timeline.png" with matplotlib
rt.close()
comm.close()
