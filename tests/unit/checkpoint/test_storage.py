"""Node-local checkpoint folders without processes: the resume agreement over every rank's view of
its own folder (:func:`vitp.checkpoint.storage.choose_resume_tag`), what each rank verifies, and
storage groups in one process."""
import json

import pytest

from vitp.checkpoint import META, verify_checkpoint
from vitp.checkpoint.storage import StorageGroups, choose_resume_tag, detect_storage_groups

T2, T4, T6 = "step_0000002", "step_0000004", "step_0000006"
WHERE = ["a:/n0", "a:/n0", "b:/n1", "b:/n1"]


def test_the_newest_tag_every_rank_has_is_chosen_and_the_others_explained():
    # node 1 (ranks 2, 3) died between the barrier and publishing step 6: node 0 has it, node 1 not
    views = [{T2: None, T4: None, T6: None}] * 2 + [{T2: None, T4: None}] * 2
    tag, notes = choose_resume_tag(views, WHERE)
    assert tag == T4
    assert notes == [f"{T6} was not published in the folder of ranks 2, 3 (b:/n1): its save did not finish "
                     f"on every node"]
    # agreeing folders: the newest, no notes; no checkpoint anywhere: start at step 0
    assert choose_resume_tag([{T2: None, T4: None}] * 4, WHERE) == (T4, [])
    assert choose_resume_tag([{}] * 4, WHERE) == (None, [])
    # keep_checkpoints deleted step 2 on node 0 only (it died before deleting): still step 4
    assert choose_resume_tag([{T4: None}] * 2 + [{T2: None, T4: None}] * 2, WHERE)[0] == T4


def test_a_damaged_chosen_tag_or_a_lost_folder_is_refused_naming_the_rank():
    bad = ("ValueError", "checkpoint file /n1/step_0000004/rng_rank00003.pt is truncated")
    views = [{T2: None, T4: None}] * 3 + [{T2: None, T4: bad}]
    with pytest.raises(ValueError, match=r"rank 3 \(b:/n1\): checkpoint file .*rng_rank00003.pt is truncated"):
        choose_resume_tag(views, WHERE)
    missing = ("FileNotFoundError", "checkpoint file /n1/x is missing")
    with pytest.raises(FileNotFoundError, match="rank 2"):
        choose_resume_tag([{T4: None}] * 2 + [{T4: missing}, {T4: None}], WHERE)
    # node 1's folder is empty (a replaced node, or the ranks moved): never a silent start from step 0
    with pytest.raises(FileNotFoundError, match=r"ranks 0, 1 hold some \(newest step_0000004, a:/n0\), ranks 2, 3 "
                                                r"none \(b:/n1\).*merged folder.*trainer.init_from"):
        choose_resume_tag([{T2: None, T4: None}] * 2 + [{}] * 2, WHERE)


def test_a_rank_verifies_only_the_files_it_loads(tmp_path):
    tag = tmp_path / T2
    tag.mkdir()
    files = {"model_ema.safetensors": b"w" * 5, "rng_rank00000.pt": b"r0", "layer_01-model_00-model_states.pt": b"L"}
    for name, data in files.items():
        (tag / name).write_bytes(data)
    record = {"step": 2, "manifest": {**{n: len(d) for n, d in files.items()}, "rng_rank00001.pt": 2},
              "parts": {"model_ema.safetensors": "all", "rng_rank00000.pt": [0], "rng_rank00001.pt": [1],
                        "layer_01-model_00-model_states.pt": [0]}}
    (tag / META).write_text(json.dumps(record))
    assert verify_checkpoint(tag, rank=0)["step"] == 2  # rank 1's RNG file lives on its own node
    with pytest.raises(FileNotFoundError, match="rng_rank00001.pt is missing"):
        verify_checkpoint(tag, rank=1)
    with pytest.raises(FileNotFoundError, match="rng_rank00001.pt is missing"):
        verify_checkpoint(tag)  # every file: a shared or merged folder
    assert verify_checkpoint(tag, names=["model_ema.safetensors"])["step"] == 2
    (tag / "model_ema.safetensors").write_bytes(b"w")
    with pytest.raises(ValueError, match="model_ema.safetensors is truncated"):
        verify_checkpoint(tag, rank=0)


def test_one_process_is_one_storage_group(tmp_path):
    groups = detect_storage_groups(tmp_path / "run")
    assert groups == StorageGroups(((0,),), 0) and groups.is_leader and groups.shared
    assert not (tmp_path / "run").exists()  # nothing written
    two = StorageGroups(((0, 1), (2, 3)), 3)
    assert (two.leader, two.is_leader, two.index(1), two.shared) == (2, False, 0, False)


def test_the_fix_names_only_earlier_checkpoints_that_hold_the_ranks_part(tmp_path):
    """A node-local folder holds every node's records but only its own ranks' files: the earlier
    checkpoint a refusal suggests must hold the failing rank's files too."""
    for tag, files in ((T2, ["rng_rank00000.pt"]), (T4, ["rng_rank00000.pt", "rng_rank00001.pt"]),
                       (T6, ["rng_rank00000.pt"])):
        (tmp_path / tag).mkdir()
        for name in files:
            (tmp_path / tag / name).write_bytes(b"r")
        record = {"step": int(tag[-7:]), "manifest": {"rng_rank00000.pt": 1, "rng_rank00001.pt": 1},
                  "parts": {"rng_rank00000.pt": [0], "rng_rank00001.pt": [1]}}
        (tmp_path / tag / META).write_text(json.dumps(record))
    with pytest.raises(FileNotFoundError, match=rf"rng_rank00001.pt is missing; .*trainer.resume=.*{T4} .*"
                                                rf"complete: {T4}\)"):
        verify_checkpoint(tmp_path / T6, rank=1)
    with pytest.raises(FileNotFoundError, match=rf"complete: {T2}, {T4}\)"):
        verify_checkpoint(tmp_path / T6)  # every file: the record alone counts
    (tmp_path / T6 / META).write_text(json.dumps({"step": 6}))
    with pytest.raises(ValueError, match=r"corrupt: no key 'manifest'"):
        verify_checkpoint(tmp_path / T6, rank=0)
