"""The seed articles' DDP templates (smoke_tests/seeds/) end a rank that has trained without the
interpreter's teardown, where torch's gloo process group has aborted a finished rank (torch 2.14.1)
or hung it (torch 2.0.1). The behaviour on real torch: unit/project/test_bare_host.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SEEDS = Path(__file__).resolve().parents[3] / "smoke_tests" / "seeds"
ENDING = ["sys.stdout.flush()", "sys.stderr.flush()", "os._exit(0)"]


def _main_block(tree: ast.Module) -> list[ast.stmt]:
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'":
            return node.body
    raise AssertionError("no `if __name__ == '__main__':` block")


@pytest.mark.parametrize("seed", sorted(p.name for p in SEEDS.glob("seed_*.py")))
def test_a_seed_ends_its_rank_with_os_exit_after_flushing(seed: str) -> None:
    body = _main_block(ast.parse((SEEDS / seed).read_text()))
    assert [ast.unparse(s) for s in body[-3:]] == ENDING, [ast.unparse(s) for s in body]


def test_there_are_the_two_seed_templates() -> None:
    assert sorted(p.name for p in SEEDS.glob("seed_*.py")) == ["seed_000_resnet_ddp.py", "seed_003_simplenet_ddp.py"]
