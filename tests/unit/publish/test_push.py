"""The push stream (builder/publish/push.py): `docker push`'s JSON lines read into each layer's
progress, retries and the pushed digest."""

from __future__ import annotations

from typing import Any

from builder.publish import push

# --- the push stream ------------------------------------------------------------------------
STREAM: list[dict[str, Any]] = [
    {"status": "The push refers to repository [127.0.0.1:5999/exp/x]"},
    {"status": "Preparing", "progressDetail": {}, "id": "d3eded9260c5"},
    {"status": "Preparing", "progressDetail": {}, "id": "0cf8aeda6a98"},
    {"status": "Pushing", "progressDetail": {"current": 512, "total": 9000}, "id": "0cf8aeda6a98"},
    {"status": "Layer already exists", "progressDetail": {}, "id": "d21d823cdbff"},
    {"status": "Mounted from other/repo", "progressDetail": {}, "id": "aaaaaaaaaaaa"},
    {"status": "Pushed", "progressDetail": {}, "id": "d3eded9260c5"},
    {"status": "Retrying in 5 seconds", "progressDetail": {}, "id": "0cf8aeda6a98"},
    {"status": "Retrying in 4 seconds", "progressDetail": {}, "id": "0cf8aeda6a98"},
    {"status": "Pushing", "progressDetail": {"current": 9000, "total": 9000}, "id": "0cf8aeda6a98"},
    {"status": "Retrying in 10 seconds", "progressDetail": {}, "id": "0cf8aeda6a98"},
    {"status": "Pushed", "progressDetail": {}, "id": "0cf8aeda6a98"},
    {"status": "t1: digest: sha256:d419 size: 948"},
    {"progressDetail": {}, "aux": {"Tag": "t1", "Digest": "sha256:d419", "Size": 948}},
]


def test_push_tracker() -> None:
    t = push.PushTracker()
    for ev in STREAM:
        t.feed(ev)
    assert t.uploaded == ["d3eded9260c5", "0cf8aeda6a98"]
    assert t.existing == ["d21d823cdbff", "aaaaaaaaaaaa"]
    assert (t.digest, t.size, t.error, t.engine_retries, t.progressed) == ("sha256:d419", 948, None, 2, True)
    t.feed({"errorDetail": {"message": "dial tcp: connection refused"}, "error": "dial tcp: connection refused"})
    assert t.error == "dial tcp: connection refused"


