"""Seed 000: the DDP template of the first article ("PyTorch多卡训练环境配置与实战指南"),
kept as close to the article as possible. Every change is marked ``# ptmg:``:

- torchrun instead of mp.spawn (the article's own closing advice): rank and world
  size come from torchrun's environment, and init_method is env://;
- gloo on CPU when no GPU is visible, NCCL on GPU ``LOCAL_RANK`` otherwise;
- synthetic images (torchvision FakeData, 3x32x32, 10 classes) through the
  article's transform, instead of downloading CIFAR10;
- the epoch count, data set size, batch size and DataLoader workers are flags,
  so the smoke test runs a few steps on CPU.
- the rank ends with os._exit once its output is flushed, skipping the interpreter's teardown,
  where torch's gloo process group can abort or hang the rank (seed_003_simplenet_ddp.py says how).

    torchrun --nproc_per_node=2 seed_000_resnet_ddp.py
"""
import argparse
import os  # ptmg: torchrun's environment
import sys  # ptmg: flush before os._exit

import torch
import torch.distributed as dist
import torch.multiprocessing as mp  # noqa: F401  (the article's import; torchrun spawns now)
from torch import optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler
from torchvision import models

USE_CUDA = torch.cuda.is_available()  # ptmg: CPU + gloo when there is no GPU


def setup(rank, world_size):
    """初始化分布式训练环境"""
    dist.init_process_group(
        backend='nccl' if USE_CUDA else 'gloo',  # ptmg: was 'nccl'
        init_method='env://',  # ptmg: was 'tcp://localhost:23456'; torchrun sets MASTER_ADDR/PORT
        world_size=world_size,
        rank=rank
    )
    if USE_CUDA:  # ptmg: guard; LOCAL_RANK, so it is right on every node
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))


def cleanup():
    dist.destroy_process_group()


def train(rank, world_size, batch_size=32, epochs=5, fake_size=50000, num_workers=4):
    setup(rank, world_size)
    device = torch.device("cuda", torch.cuda.current_device()) if USE_CUDA else torch.device("cpu")  # ptmg
    # 模型必须先移到对应设备
    model = models.resnet50(pretrained=False).to(device)  # ptmg: .to(device), was .to(rank)
    ddp_model = DDP(model, device_ids=[device.index] if USE_CUDA else None)  # 单机多卡推荐用device_ids

    # 数据加载部分
    from torch.utils.data import DataLoader
    from torchvision import transforms
    from torchvision.datasets import FakeData  # ptmg: was CIFAR10 (a download)
    transform = transforms.Compose([
        transforms.ToTensor(),
        transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    ])
    # ptmg: was CIFAR10(root='./data', train=True, download=True, transform=transform)
    dataset = FakeData(size=fake_size, image_size=(3, 32, 32), num_classes=10, transform=transform)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)
    dataloader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers)

    criterion = torch.nn.CrossEntropyLoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.01)

    ddp_model.train()
    for epoch in range(epochs):  # ptmg: was range(5)
        sampler.set_epoch(epoch)  # 非常关键！确保每轮数据打乱不同  # noqa: RUF003
        for i, (inputs, labels) in enumerate(dataloader):
            inputs, labels = inputs.to(device), labels.to(device)  # noqa: PLW2901  # ptmg: was .to(rank)
            optimizer.zero_grad()
            outputs = ddp_model(inputs)
            loss = criterion(outputs, labels)
            loss.backward()
            optimizer.step()

            if i % 100 == 0 and rank == 0:
                print(f"Epoch {epoch}, Step {i}, Loss: {loss.item():.4f}", flush=True)

    cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--world_size", type=int, default=2)  # ignored under torchrun
    parser.add_argument("--batch_size", type=int, default=32)  # ptmg: flags for a short run
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--fake_size", type=int, default=50000)
    parser.add_argument("--num_workers", type=int, default=4)
    args = parser.parse_args()
    # ptmg: was mp.spawn(train, args=(args.world_size,), nprocs=args.world_size, join=True)
    train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args.batch_size,
          args.epochs, args.fake_size, args.num_workers)
    sys.stdout.flush()  # ptmg: end without the interpreter's teardown (see the docstring)
    sys.stderr.flush()
    os._exit(0)
