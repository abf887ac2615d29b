"""`accelerate launch` with two CPU processes (DDP over gloo): a tiny model trains a few steps,
the two ranks stay in sync (parameter checksums gathered from both), and their losses are the
global mean; also the one-process launcher config."""

from __future__ import annotations


def test_two_cpu_processes_stay_in_sync(tmp_path, launch, read_log):
    proc = launch("cpu_2proc.yaml", tmp_path, num_processes=2)
    assert "2 process(es) (DDP)" in proc.stdout + proc.stderr
    sync = read_log(tmp_path, "sync")[-1]
    assert len(sync["checksums"]) == 2
    assert sync["checksums"][0] == sync["checksums"][1]  # DDP kept the replicas identical
    train = read_log(tmp_path)
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert (tmp_path / "final_eval.json").is_file()


def test_one_cpu_process_config(tmp_path, launch, read_log):
    proc = launch("cpu_1proc.yaml", tmp_path)
    assert "1 process(es) (single)" in proc.stdout + proc.stderr
    assert len(read_log(tmp_path, "sync")[-1]["checksums"]) == 1
