"""Seed 003: the DDP template of the second article ("PyTorch-CUDA多卡并行训练实战"),
kept as close to the article as possible. Every change is marked ``# ptmg:``:

- the article uses ``SimpleNet`` without defining it: here it is one Linear(10, 1),
  the smallest model that fits the article's TensorDataset(randn(1000, 10), randn(1000, 1));
- torchrun instead of mp.spawn: rank and world size come from torchrun's
  environment, and MASTER_ADDR/PORT are only defaults (torchrun's values win);
- gloo on CPU when no GPU is visible, NCCL on GPU ``LOCAL_RANK`` otherwise;
- rank 0 prints one line at the end, so a test can tell that training ran;
- a barrier before destroy_process_group, so no rank leaves while another is still in a collective;
- the rank ends with os._exit once its output is flushed, skipping the interpreter's teardown (see
  the end of the file).

    torchrun --nproc_per_node=2 seed_003_simplenet_ddp.py
"""
import os
import sys  # ptmg: flush before os._exit

import torch
import torch.distributed as dist
import torch.multiprocessing as mp  # noqa: F401  (the article's import; torchrun spawns now)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

USE_CUDA = torch.cuda.is_available()  # ptmg: CPU + gloo when there is no GPU


class SimpleNet(torch.nn.Module):  # ptmg: missing from the article
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(10, 1)

    def forward(self, x):
        return self.fc(x)


def setup_ddp(rank, world_size):
    """初始化分布式环境"""
    os.environ.setdefault('MASTER_ADDR', 'localhost')  # ptmg: setdefault, was os.environ[...] =
    os.environ.setdefault('MASTER_PORT', '12355')
    dist.init_process_group("nccl" if USE_CUDA else "gloo", rank=rank, world_size=world_size)  # ptmg


def cleanup_ddp():
    dist.destroy_process_group()


def train_epoch(model, dataloader, optimizer, criterion, device):
    model.train()
    for data, target in dataloader:
        data, target = data.to(device), target.to(device)  # noqa: PLW2901
        output = model(data)
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss.item()  # ptmg: returned for the final line


def train_ddp(rank, world_size):
    setup_ddp(rank, world_size)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))  # ptmg: the GPU on this node
    device = torch.device(f"cuda:{local_rank}") if USE_CUDA else torch.device("cpu")  # ptmg
    if USE_CUDA:
        torch.cuda.set_device(device)  # ptmg
    model = SimpleNet().to(device)
    ddp_model = DDP(model, device_ids=[local_rank] if USE_CUDA else None)  # ptmg: None on CPU

    dataset = torch.utils.data.TensorDataset(
        torch.randn(1000, 10), torch.randn(1000, 1)
    )
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)
    dataloader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)

    optimizer = torch.optim.Adam(ddp_model.parameters())
    criterion = torch.nn.MSELoss()

    for epoch in range(10):
        sampler.set_epoch(epoch)  # 确保各epoch打乱方式不同
        loss = train_epoch(ddp_model, dataloader, optimizer, criterion, device)

    if rank == 0:  # ptmg: proof of a finished run
        print(f"seed_003 done: world_size={world_size} epochs=10 last_loss={loss:.4f}", flush=True)
    dist.barrier()  # ptmg: every rank done with its collectives before any rank leaves
    cleanup_ddp()


if __name__ == "__main__":
    # ptmg: was world_size = torch.cuda.device_count();
    #       mp.spawn(train_ddp, args=(world_size,), nprocs=world_size, join=True)
    train_ddp(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    # ptmg: end here, without the interpreter's teardown. A torch 2.14.1 gloo worker thread can still be
    # freeing a finished collective when the interpreter finalizes; the work's thread-local state holds
    # a Python object, so the worker takes the GIL during Py_FinalizeEx, Python ends that thread, and
    # the C++ runtime aborts the rank: "terminate called without an active exception" after training,
    # about one CPU run in a hundred (a core dump's backtrace: ProcessGroupGloo::runLoop ->
    # ~AsyncWork -> ~ThreadLocalState -> gil_scoped_acquire -> pthread_exit -> std::terminate).
    # torch 2.0.1's gloo deadlocked on the GIL at the same point instead. The rank's work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
