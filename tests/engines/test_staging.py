"""Stage folders shared by a fleet's replicas on one node: what a dead replica left behind, and
what a retried write writes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from rollfleet.engines.sglang.staging import WEIGHTS_FILE, StageFolders
from rollfleet.engines.vllm.staging import StageDir
from rollfleet.errors import InvalidRequest

pytestmark = pytest.mark.unit


def dead_pid() -> int:
    """The pid of a process that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_version_only_a_dead_replica_links_is_written_again_and_its_memory_freed(tmp_path):
    """A replica killed before it released its link (a fenced update, shut down past its timeout)
    kept the file forever, and a retry of that version with other weights loaded the old file."""
    gone = StageDir(tmp_path, "fleet-x", owner=f"{dead_pid()}-abcdef12")
    gone.stage({"w": torch.zeros(2)}, 5)
    live = StageDir(tmp_path, "fleet-x")
    staged = live.stage({"w": torch.full((2,), 7.0)}, 5)
    assert staged.written > 0 and torch.equal(load_file(str(staged.files[0]))["w"], torch.full((2,), 7.0))
    gone.stage({"w": torch.zeros(2)}, 6)  # its link of 6 too, left behind
    live.stage({"w": torch.ones(2)}, 7)
    assert live.release_older(7) == [5, 6]
    live.release_all()
    assert not tmp_path.joinpath("fleet-x").exists()  # nothing pinned on tmpfs


def test_a_half_written_file_of_a_replica_killed_while_writing_is_removed_by_the_next_stage(tmp_path):
    """Killed mid-write (a stage timed out and its replica was restarted), a replica never removed
    its temporary file: up to a whole model's copy held in tmpfs until the node rebooted."""
    folder = tmp_path / "fleet-x"
    folder.mkdir()
    killed = folder / f".v5.{dead_pid()}-abcdef12.a1b2c3.tmp"
    writing = folder / f".v5.{os.getpid()}-12345678.d4e5f6.tmp"  # a live process's write in progress
    killed.write_bytes(b"x" * 1024)
    writing.write_bytes(b"y")
    StageDir(tmp_path, "fleet-x").stage({"w": torch.ones(2)}, 5)
    assert not killed.exists() and writing.exists()


def test_a_state_dict_given_as_pairs_is_written_whole_on_a_retry_and_an_empty_one_is_refused(tmp_path, monkeypatch):
    """The first try used up an iterable of pairs; the retry (the shared file vanished meanwhile,
    its last user released it) wrote a file of no tensors, and the load of nothing succeeded."""
    import rollfleet.engines.vllm.staging as vllm_staging

    stage = StageDir(tmp_path, "fleet-y")
    link = os.link
    calls = {"n": 0}

    def vanish_once(src, dst):  # another replica releases the file between our write and our link
        calls["n"] += 1
        if calls["n"] == 1:
            os.unlink(src)
        return link(src, dst)

    monkeypatch.setattr(vllm_staging.os, "link", vanish_once)
    staged = stage.stage(iter([("a", torch.ones(2)), ("b", torch.zeros(3))]), 5)
    assert sorted(load_file(str(staged.files[0]))) == ["a", "b"]
    monkeypatch.undo()
    for empty in ({}, iter([])):
        with pytest.raises(InvalidRequest) as err:
            stage.stage(empty, 6)
        assert err.value.field == "weights"
    folders = StageFolders(tmp_path, "fleet-z")
    staged_folder = folders.stage(iter([("a", torch.ones(2))]), 5)
    assert list(load_file(str(staged_folder.folder / WEIGHTS_FILE))) == ["a"]
    with pytest.raises(InvalidRequest):
        folders.stage({}, 6)
