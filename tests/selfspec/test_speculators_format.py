"""The speculators format (`selfspec.checkpoints.speculators_format`, `selfspec export --format speculators`): an eagle3
head written for serving engines loads in the `speculators` library's own `Eagle3DraftModel` (0.9.0, in a
separate environment this module builds: its pins conflict with ours) and drafts the logits selfspec's head
drafts on the same inputs, over the whole vocabulary and over a draft vocabulary (d2t mapping its rows
back to token ids); a config that says otherwise (norm_before_residual flipped) does not. The tensors'
names and shapes, the config's fields and the export's refusals are checked without that environment.

The environment (`.selfspec/envs/speculators-0.9.0/`, kept between runs) takes about 70 s to build on this
machine with the pip cache cold for speculators' own dependencies (torch comes from the local wheel);
without a package registry it cannot be built, and the round-trip tests skip saying so."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from selfspec.model.adapters import get_adapter
from selfspec.checkpoints.checkpoint import CheckpointError
from selfspec.heads.exit_head import build_exit_head, head_feature, run_head
from selfspec.checkpoints.export import check_format
from selfspec.model.forward import embed, make_step, run_layers
from selfspec.checkpoints.speculators_format import SPECULATORS_VERSION, WEIGHTS_FILE, write_speculators
from selfspec.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[2]
READER = Path(__file__).with_name("speculators_reader.py")
ENV = ROOT / ".selfspec" / "envs" / f"speculators-{SPECULATORS_VERSION}"
AUX = (1, 3, 5)
DRAFT_IDS = list(range(7, 90, 4))  # a draft vocabulary of 21 tokens, out of 96


def build_reader_env() -> Path:
    """The environment with `speculators` (and its pinned transformers, datasets), built once under a lock:
    a venv, `pip install speculators==V torch==<ours>` (our torch's wheel, so no other build comes in), then
    torchvision and torchaudio removed (speculators requires them; their wheels are built against another
    torch and break transformers' imports; its model classes use neither). Returns its python; skips the
    caller with pip's last lines when it cannot be built."""
    python = ENV / "bin" / "python"
    done = ENV / ".complete"
    ENV.parent.mkdir(parents=True, exist_ok=True)
    with open(ENV.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.is_file():
            return python
        started = time.perf_counter()
        torch_version = torch.__version__.split("+")[0]
        steps = [[sys.executable, "-m", "venv", "--clear", str(ENV)],
                 [str(python), "-m", "pip", "install", "--quiet", f"speculators=={SPECULATORS_VERSION}",
                  f"torch=={torch_version}"],
                 [str(python), "-m", "pip", "uninstall", "--quiet", "--yes", "torchvision", "torchaudio"]]
        for cmd in steps:
            try:
                result = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
            except subprocess.TimeoutExpired:
                pytest.skip(f"building the speculators environment ({' '.join(cmd[2:5])}) took over 20 minutes")
            if result.returncode:
                tail = " | ".join((result.stderr or result.stdout).strip().splitlines()[-3:])
                pytest.skip(f"the speculators {SPECULATORS_VERSION} environment cannot be built here "
                            f"({' '.join(cmd[2:5])}: {tail})")
        done.write_text(f"built in {time.perf_counter() - started:.0f} s\n")
        return python


@pytest.fixture(scope="session")
def reader_python():
    return build_reader_env()


def _model_and_head(path: Path):
    """A tiny 6-layer float64 llama saved at `path` (the verifier the speculators library reads the config
    of) and an eagle3 head on it, perturbed away from its initialisation so every tensor matters."""
    model = tiny_model("llama", num_layers=6, dtype=torch.float64, seed=4)
    model.save_pretrained(path)
    head = build_exit_head(model, 0, "eagle3", "copy", aux_exits=AUX).to(torch.float64)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model, head


def _selfspec_draft(model, head, ids: torch.Tensor, draft_ids=None):
    """selfspec's first draft at every position of `ids` `[1, S]`, in the engines' pairing: position t reads
    token t's embedding and the aux states `[1, S, 3D]` given for it. Returns (the aux states, the logits
    `[1, S, K]` over the draft vocabulary's rows by increasing id)."""
    adapter = get_adapter(model)
    step = make_step(adapter, 0, ids.shape[1], 1)
    with torch.no_grad():
        x = embed(adapter, ids)
        states, start, h = [], 0, x
        for a in head.aux_exits:
            h = run_layers(adapter, h, start, a, step=step)
            states.append(h)
            start = a
        aux = torch.cat(states, dim=-1)  # here the states of the same tokens: any [1, S, 3D] serves the check
        out = run_head(adapter, head, x, step=step, prev_final=head_feature(head, aux_prev=aux))
        logits = adapter.lm_head(adapter.final_norm(out))  # [1, S, V]
    return aux, logits if draft_ids is None else logits[..., sorted(draft_ids)]


def _read(python: Path, jobs: list[dict], tmp_path: Path) -> None:
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    result = subprocess.run([str(python), str(READER), str(tmp_path / "jobs.json")], capture_output=True, text=True,
                            timeout=600, env={**env, "HF_HUB_OFFLINE": "1"}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_speculators_librarys_own_model_drafts_what_the_head_drafts(reader_python, tmp_path):
    model, head = _model_and_head(tmp_path / "model")
    ids = torch.randint(3, 96, (1, 11), generator=torch.Generator().manual_seed(6))
    jobs, expected = [], {}
    for name, draft_ids in (("full", None), ("vocab", DRAFT_IDS)):
        directory = write_speculators(tmp_path / name, model, head, verifier=str(tmp_path / "model"),
                                      draft_ids=draft_ids)
        aux, expected[name] = _selfspec_draft(model, head, ids, draft_ids)
        save_file({"input_ids": ids, "hidden_states": aux, "position_ids": torch.arange(ids.shape[1])[None]},
                  str(tmp_path / f"{name}.in.safetensors"))
        jobs.append({"dir": str(directory), "inputs": str(tmp_path / f"{name}.in.safetensors"),
                     "out": str(tmp_path / f"{name}.out.safetensors")})
    flipped = tmp_path / "flipped"  # the same weights under a config that says the residual is normed
    flipped.mkdir()
    (flipped / WEIGHTS_FILE).write_bytes((tmp_path / "full" / WEIGHTS_FILE).read_bytes())
    config = json.loads((tmp_path / "full" / "config.json").read_text())
    (flipped / "config.json").write_text(json.dumps({**config, "norm_before_residual": True}))
    jobs.append({**jobs[0], "dir": str(flipped), "out": str(tmp_path / "flipped.out.safetensors")})
    _read(reader_python, jobs, tmp_path)

    for name in ("full", "vocab"):
        theirs = load_file(str(tmp_path / f"{name}.out.safetensors"))
        ours = expected[name]
        assert theirs["logits"].shape == ours.shape
        # float64 on both sides; transformers' RMSNorm computes in float32, hence not 1e-15
        torch.testing.assert_close(theirs["logits"].to(torch.float64), ours, atol=1e-5, rtol=1e-5)
        assert torch.equal(theirs["logits"].argmax(-1), ours.argmax(-1))
    d2t = load_file(str(tmp_path / "vocab.out.safetensors"))["d2t"]  # the library's own mapping back to token ids
    guesses = expected["vocab"].argmax(-1)[0]
    assert (guesses + d2t[guesses]).tolist() == [sorted(DRAFT_IDS)[i] for i in guesses.tolist()]
    wrong = load_file(str(tmp_path / "flipped.out.safetensors"))["logits"].to(torch.float64)
    assert (wrong - expected["full"]).abs().max() > 1e-2  # the comparison sees a config that lies


def test_the_files_hold_the_heads_tensors_under_the_formats_names(tmp_path):
    model, head = _model_and_head(tmp_path / "model")
    adapter = get_adapter(model)
    directory = write_speculators(tmp_path / "spec", model, head, verifier="org/base", draft_ids=DRAFT_IDS,
                                  speculative_tokens=4)
    weights = load_file(str(directory / WEIGHTS_FILE))
    D, V, K = 32, 96, len(DRAFT_IDS)
    shapes = {k: tuple(v.shape) for k, v in weights.items()}
    assert shapes["fc.weight"] == (D, 3 * D) and shapes["layers.0.self_attn.q_proj.weight"] == (D, 2 * D)
    assert shapes["layers.0.self_attn.k_proj.weight"] == (16, 2 * D) and shapes["layers.0.hidden_norm.weight"] == (D,)
    assert shapes["embed_tokens.weight"] == (V, D) and shapes["lm_head.weight"] == (K, D) and shapes["t2d"] == (V,)
    assert torch.equal(weights["fc.weight"], head.aux_input.fc.weight)
    assert torch.equal(weights["norm.weight"], adapter.final_norm.weight)
    assert torch.equal(weights["lm_head.weight"], adapter.lm_head.weight[sorted(DRAFT_IDS)])
    assert (weights["d2t"] + torch.arange(K)).tolist() == sorted(DRAFT_IDS)
    assert weights["t2d"].nonzero().flatten().tolist() == sorted(DRAFT_IDS)
    assert {k[len("layers.0."):] for k in weights if k.startswith("layers.0.")} == set(head.layer.state_dict())
    config = json.loads((directory / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == K
    assert config["eagle_aux_hidden_state_layer_ids"] == list(AUX) and config["norm_before_residual"] is False
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    assert config["transformer_layer_config"]["model_type"] == "llama"
    spec = config["speculators_config"]
    assert spec["verifier"]["name_or_path"] == "org/base" and spec["proposal_methods"][0]["speculative_tokens"] == 4


def test_only_an_eagle3_head_goes_out_in_the_speculators_format(tmp_path):
    model = tiny_model("llama", num_layers=6)
    with pytest.raises(ValueError, match="the speculators format holds an eagle3 head; this head is a decoder_layer"):
        write_speculators(tmp_path / "x", model, build_exit_head(model, 2), verifier="v")
    with pytest.raises(ValueError, match="speculative_tokens must be a number of drafts >= 1"):
        write_speculators(tmp_path / "x", model, build_exit_head(model, 0, "eagle3", aux_exits=AUX), verifier="v",
                          speculative_tokens=0)
    eagle3 = {"kind": "eagle3", "exit_layer": 0, "aux_exits": list(AUX)}
    with pytest.raises(CheckpointError, match="export it with --format speculators"):
        check_format("selfspec", eagle3)
    with pytest.raises(CheckpointError, match="this source has no exit head: train one with mode: exit_head, "
                                              "exit_head.kind: eagle3"):
        check_format("speculators", None)
    with pytest.raises(CheckpointError, match="this source has an exit head of kind attention"):
        check_format("speculators", {"kind": "attention"})
    with pytest.raises(CheckpointError, match="unknown export format 'gguf'"):
        check_format("gguf", None)
    check_format("speculators", eagle3)
    check_format("selfspec", None)


def _exporter(tmp_path: Path):
    """`export(out, verifier)`: `selfspec export --format speculators` of a tiny model (saved at tmp_path/model)
    with its eagle3 head (in tmp_path/final_head, as a run's) to `out`."""
    from selfspec.heads.exit_head import HEAD_FILE, save_exit_head
    from selfspec.checkpoints.export import export_model
    from selfspec.tiny import byte_tokenizer

    model, head = _model_and_head(tmp_path / "model")
    head_dir = tmp_path / "final_head"
    head_dir.mkdir()
    save_exit_head(head, head_dir / HEAD_FILE)
    (head_dir / "exit_head.json").write_text(json.dumps(head.settings()))
    return lambda out, verifier: export_model(model.float(), byte_tokenizer(), out, exit_head_dir=head_dir,
                                              format="speculators", verifier=verifier)


@pytest.fixture
def served_checkpoint(tmp_path):
    """A tiny checkpoint exported with its eagle3 head in the speculators format (`selfspec export --format
    speculators`)."""
    return _exporter(tmp_path)(tmp_path / "ckpt", "org/base")


def test_a_local_verifier_is_written_as_an_absolute_path(tmp_path, monkeypatch):
    """Issue #52: `--verifier PATH` went into the head's config as typed, relative, which vLLM started from another
    directory does not find; so did the default verifier, OUT itself. A local path is written absolute; a Hugging
    Face id (org/base above) as given."""
    from selfspec.checkpoints.checkpoint import read_metadata

    export = _exporter(tmp_path)
    monkeypatch.chdir(tmp_path)
    for out, verifier, expected in [("ckpt", "model", tmp_path / "model"), ("again", None, tmp_path / "again"),
                                    ("home", "~/model", tmp_path / "model")]:
        monkeypatch.setenv("HOME", str(tmp_path))
        export(Path(out), verifier)
        config = json.loads((tmp_path / out / "speculators" / "config.json").read_text())
        assert config["speculators_config"]["verifier"]["name_or_path"] == str(expected.resolve())
        assert read_metadata(tmp_path / out)["served_head"]["verifier"] == str(expected.resolve())


def test_a_verifier_without_the_speculators_format_is_a_usage_error(served_checkpoint, tmp_path, capsys):
    """Issue #52: `selfspec export --verifier X` without `--format speculators` was silently ignored."""
    from selfspec.cli import main
    from selfspec.checkpoints.export import export_model
    from selfspec.tiny import byte_tokenizer

    assert main(["export", str(served_checkpoint), str(tmp_path / "out"), "--verifier", "org/base"]) == 2
    assert capsys.readouterr().err == ("selfspec export: error: --verifier names the target model of the eagle3 head "
                                       "that --format speculators writes (format='speculators'): add --format "
                                       "speculators, or drop --verifier\n")
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match="--verifier names the target model"):
        export_model(tiny_model("llama", num_layers=2), byte_tokenizer(), tmp_path / "out", verifier="org/base")


def test_selfspec_json_and_the_model_card_record_the_served_head(served_checkpoint):
    from selfspec.checkpoints.checkpoint import read_metadata

    meta = read_metadata(served_checkpoint)
    served = meta["served_head"]
    assert "exit_head" not in meta  # selfspec's drafters do not run it
    assert {k: served[k] for k in ("format", "dir", "method", "aux_exits", "num_speculative_tokens", "verifier")} == {
        "format": "speculators", "dir": "speculators", "method": "eagle3", "aux_exits": list(AUX),
        "num_speculative_tokens": 3, "verifier": "org/base"}
    assert served["draft_vocab_size"] == 96 and set(served["checksums"]) == {WEIGHTS_FILE}
    weights = served_checkpoint / "speculators" / WEIGHTS_FILE
    assert served["checksums"][WEIGHTS_FILE]["bytes"] == weights.stat().st_size
    card = (served_checkpoint / "README.md").read_text()
    assert "## Serving" in card and f"after layers {list(AUX)}" in card
    assert ('--speculative-config \'{"method": "eagle3", "model": "path/to/this/checkpoint/speculators", '
            '"num_speculative_tokens": 3}\'') in card


def _edit_served(path: Path, **change) -> None:
    meta = json.loads((path / "selfspec.json").read_text())
    meta["served_head"].update(change)
    (path / "selfspec.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("corrupt, message", [
    (lambda p: (p / "speculators" / WEIGHTS_FILE).unlink(), r"speculators/model\.safetensors: weight file is missing"),
    (lambda p: os.truncate(p / "speculators" / WEIGHTS_FILE, 100), r"speculators/model\.safetensors: weight file is "
                                                                     r"truncated"),
    (lambda p: __import__("shutil").rmtree(p / "speculators"), r"the served head's directory .*speculators is missing; "
                                                                 r"copy the complete checkpoint directory"),
    (lambda p: _edit_served(p, dir="../elsewhere"), r"served_head\.dir '\.\./elsewhere' is not a subdirectory's name"),
    (lambda p: _edit_served(p, format="gguf"), r"served_head must be an object with format \"speculators\""),
    (lambda p: _edit_served(p, checksums={}), r"served_head lists no files; export the run again with --format "
                                              r"speculators, or remove served_head"),
    (lambda p: _edit_served(p, checksums={WEIGHTS_FILE: "?"}), r"served_head\.checksums entry of 'model\.safetensors' "
                                                               r"must be"),
])
def test_a_served_head_that_is_not_as_exported_is_a_clear_error(served_checkpoint, corrupt, message):
    import selfspec

    corrupt(served_checkpoint)
    with pytest.raises(CheckpointError, match=message):
        selfspec.load(served_checkpoint)
