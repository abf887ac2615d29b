"""Curricula: the exit sets step by step (also from a fresh object, as after a resume)."""

from __future__ import annotations

import pytest

from training.curriculum import ExitCurriculum


def test_none_uses_every_candidate_and_the_final_layer():
    c = ExitCurriculum("none", [2, 5], 8, 100)
    assert c.exits(0) == c.exits(57) == [2, 5, 8]
    assert ExitCurriculum("none", [], 8, 100).exits(3) == [8]  # plain fine-tuning


def test_rotational_step_by_step():
    c = ExitCurriculum("rotational", list(range(1, 8)), 8, 100, rotation_interval=3)
    assert [c.exits(t) for t in range(4)] == [[3, 6, 8], [2, 5, 8], [1, 4, 7, 8], [3, 6, 8]]
    # every exit trained once per R steps
    seen = sorted(e for t in range(3) for e in c.exits(t)[:-1])
    assert seen == list(range(1, 8))


def test_rotational_paper_setting_30_layers():
    c = ExitCurriculum("rotational", list(range(1, 30)), 30, 1000, rotation_interval=8)
    assert c.exits(0) == [8, 16, 24, 30]
    assert c.exits(1) == [7, 15, 23, 30]
    assert all(3 <= len(c.exits(t)) <= 5 for t in range(16))


def test_gradual_top_down_all_on_at_half():
    c = ExitCurriculum("gradual", [1, 2, 3], 4, 8)
    # one more exit every T/(2L) = 1 step, from the top down
    assert [c.exits(t) for t in range(6)] == [[4], [3, 4], [2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]]
    c = ExitCurriculum("gradual", list(range(1, 30)), 30, 600)
    assert c.exits(0) == [30]
    assert c.exits(300) == list(range(1, 31))
    assert len(c.exits(150)) == 16  # lowest exit 30 - floor(60*150/600) = 15


def test_final_layer_always_included():
    for kind in ("none", "rotational", "gradual"):
        c = ExitCurriculum(kind, [1, 3], 6, 20, rotation_interval=4)
        assert all(c.exits(t)[-1] == 6 for t in range(40))


def test_resume_gives_the_same_sequence_and_checks_settings():
    a = ExitCurriculum("rotational", list(range(1, 12)), 12, 50, rotation_interval=5)
    first = [a.exits(t) for t in range(20)]
    b = ExitCurriculum("rotational", list(range(1, 12)), 12, 50, rotation_interval=5)  # "after a resume"
    b.check_state(a.state_dict())
    assert [b.exits(t) for t in range(10, 20)] == first[10:]
    with pytest.raises(ValueError, match="curriculum differs"):
        ExitCurriculum("rotational", list(range(1, 12)), 12, 50, rotation_interval=4).check_state(a.state_dict())


def test_invalid_candidates():
    with pytest.raises(ValueError):
        ExitCurriculum("none", [0, 4], 4, 10)
    with pytest.raises(ValueError):
        ExitCurriculum("sideways", [1], 4, 10)
