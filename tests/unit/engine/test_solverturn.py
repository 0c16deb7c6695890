"""A --no-cache build runs alone on its engine and platform; cached builds run at once (real flock locks,
real threads; each turn is taken as Engine.build takes it, around the build's CLI)."""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from builder.common import flock
from builder.engine import docker as engine_docker
from builder.engine import solverturn
from builder.engine.buildkit import BuildkitCli
from builder.engine.model import BuildOutcome, BuildRequest

HOST = {"DOCKER_HOST": "unix:///run/test-engine.sock"}
WAIT = 0.5  # how long a turn that must wait is watched not starting


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


class Holder:
    """A thread that takes a turn, says when it has it, and keeps it until released."""

    def __init__(self, env: dict[str, str], platform: str | None, no_cache: bool) -> None:
        self.has, self.release = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, args=(env, platform, no_cache), daemon=True)
        self.thread.start()

    def _run(self, env: dict[str, str], platform: str | None, no_cache: bool) -> None:
        with solverturn.turn(env, platform, no_cache):
            self.has.set()
            self.release.wait(10)

    def end(self) -> None:
        self.release.set()
        self.thread.join(10)


@pytest.fixture
def holders() -> Iterator[Callable[..., Holder]]:
    made: list[Holder] = []

    def make(env: dict[str, str] = HOST, platform: str | None = None, no_cache: bool = False) -> Holder:
        made.append(Holder(env, platform, no_cache))
        return made[-1]

    yield make
    for h in made:
        h.end()


def test_cached_builds_run_at_once(holders: Callable[..., Holder]) -> None:
    first, second = holders(), holders()
    assert first.has.wait(5) and second.has.wait(5)


def test_a_no_cache_build_waits_for_the_running_build_and_then_runs_alone(holders: Callable[..., Holder]) -> None:
    cached = holders()
    assert cached.has.wait(5)
    alone = holders(no_cache=True)
    assert not alone.has.wait(WAIT), "the --no-cache build started beside a running build"
    cached.end()
    assert alone.has.wait(5)
    later = holders()
    assert not later.has.wait(WAIT), "a build started beside the running --no-cache build"
    alone.end()
    assert later.has.wait(5)


def test_another_platform_or_engine_does_not_wait(holders: Callable[..., Holder]) -> None:
    assert holders(no_cache=True).has.wait(5)
    assert holders(platform="linux/arm64").has.wait(5)
    assert holders(env={"DOCKER_HOST": "unix:///run/other.sock"}, no_cache=True).has.wait(5)


def test_the_default_host_is_the_engines_socket() -> None:
    assert solverturn.lock_path({}, None) == solverturn.lock_path({"DOCKER_HOST": solverturn.DEFAULT_HOST}, None)
    assert solverturn.lock_path({}, None).name.endswith("-native.lock")
    assert solverturn.lock_path({}, "linux/arm64").name.endswith("-linux_arm64.lock")


@pytest.mark.parametrize(("no_cache", "said"), [(True, "a --no-cache build runs alone on its engine"),
                                                (False, "waiting for a --no-cache build on this engine to end")])
def test_a_waiting_build_says_why(no_cache: bool, said: str, holders: Callable[..., Holder],
                                  caplog: pytest.LogCaptureFixture) -> None:
    first = holders(no_cache=not no_cache)
    assert first.has.wait(5)
    second = holders(no_cache=no_cache)
    assert not second.has.wait(WAIT)
    assert said in caplog.text and caplog.text.count("waiting for") == 1, caplog.text
    first.end()
    assert second.has.wait(5)


def test_a_free_lock_says_nothing_and_a_held_one_waits_with_or_without_a_word(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "locks" / "x.lock"
    calls: list[int] = []
    with flock.held(path, shared=True, on_wait=lambda: calls.append(1)):
        pass
    assert calls == []
    old = os.umask(0o022)
    try:
        with flock.exclusive(path):
            assert stat.S_IMODE(path.stat().st_mode) == 0o644
    finally:
        os.umask(old)
    holder_has, release = threading.Event(), threading.Event()

    def hold() -> None:
        with flock.exclusive(path):
            holder_has.set()
            release.wait(10)

    threading.Thread(target=hold, daemon=True).start()
    assert holder_has.wait(5)
    got: list[str] = []
    waiters = [threading.Thread(target=lambda: got.append(_take(path, None)), daemon=True),
               threading.Thread(target=lambda: got.append(_take(path, lambda: calls.append(2))), daemon=True)]
    for w in waiters:
        w.start()
    time.sleep(WAIT)
    assert got == [] and calls == [2]
    release.set()
    for w in waiters:
        w.join(5)
    assert sorted(got) == ["taken", "taken"]


def _take(path: Path, on_wait: Callable[[], None] | None) -> str:
    with flock.held(path, shared=False, on_wait=on_wait):
        return "taken"


def test_engine_build_takes_the_turn_around_the_cli(tmp_path: Path, holders: Callable[..., Holder],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine.build, the one door to BuildKit: its --no-cache build does not start while a build runs."""
    started = threading.Event()

    def fake_cli_build(req: BuildRequest, on_line: Callable[[str], None], cli: BuildkitCli) -> BuildOutcome:
        started.set()
        return BuildOutcome(False, None, "buildkit", "stub")

    monkeypatch.setattr(engine_docker, "build_with_cli", fake_cli_build)
    engine: Any = engine_docker.Engine(client=object())
    cli = BuildkitCli("/usr/bin/docker", ("build",), HOST)
    req = BuildRequest(tmp_path, tmp_path / "Dockerfile", {}, {}, tmp_path / "logs" / "b.log", no_cache=True)
    running = holders()
    assert running.has.wait(5)
    worker = threading.Thread(target=engine.build, args=(req, lambda _l: None, cli), daemon=True)
    worker.start()
    time.sleep(WAIT)
    assert not started.is_set(), "Engine.build ran a --no-cache build beside a running one"
    running.end()
    worker.join(5)
    assert started.is_set()
