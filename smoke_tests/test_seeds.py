"""The DDP templates of the seed articles run in this image (under torchrun)."""

from __future__ import annotations

import os

import pytest

import run_ddp
from smokelib import SmokeConfig

pytestmark = [pytest.mark.seed, pytest.mark.ddp]

SEEDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seeds")

#: seed script -> (extra arguments, a line that proves rank 0 trained)
CASES = {
    "seed_000_resnet_ddp": (["--epochs", "1", "--fake_size", "32", "--batch_size", "4",
                             "--num_workers", "2"], "Epoch 0, Step 0, Loss:"),
    "seed_003_simplenet_ddp": ([], "seed_003 done: world_size="),
}


@pytest.mark.parametrize("seed", sorted(CASES))
def test_seed_template(seed: str, smoke: SmokeConfig) -> None:
    args, marker = CASES[seed]
    nproc = smoke.nproc if smoke.nproc is not None else 2
    launch = run_ddp.launch(nproc, script=os.path.join(SEEDS, seed + ".py"), script_args=args,
                            timeout=min(smoke.ddp_timeout, 240))
    tail = "\n".join(launch.output.splitlines()[-30:])
    assert not launch.timed_out, f"{seed} hit the hard timeout:\n{tail}"
    assert launch.returncode == 0, f"{seed} exited {launch.returncode}:\n{tail}"
    assert marker in launch.output, f"{seed} ran but did not train (no {marker!r}):\n{tail}"
