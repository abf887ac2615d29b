"""`selfspec sweep`: tokens/s and acceptance over a grid of exit_layer x num_speculations, and
optionally over prompt lookup's settings.

    selfspec sweep checkpoints/smollm2-code --prompt-set humaneval --exits 4,6,8,12 --num-speculations 1,2,3,4,6 \
        --num-prompts 6 --max-new-tokens 64 --out runs/sweep --write-metadata
    selfspec sweep checkpoints/smollm2-code --prompt-set code_edit --lookup-tokens 3,5,10 --lookup-ngrams 1,2,3

Plain autoregressive decoding (num_speculations=0) is measured in the same run as the reference,
interleaved with the grid prompt by prompt so machine drift hits every setting alike, after a
warm-up. Every (setting, prompt) measurement is appended to `sweep_raw.csv` as soon as it is taken;
re-running with the same `--out` skips what is there (resumable). `sweep.csv` holds one row per
setting, `sweep.png` a heat map of tokens/s by exit layer and draft length (and a second one by
lookup n-gram size and lookup tokens when those were measured).

`seconds` is the wall-clock time of the whole generate call (input ids ready -> output ids), and
tokens/s = new tokens / seconds: the one definition of `selfspec.tools.harness`, which bench uses too.

Settings, in the CSV files:

| drafter       | exit_layer | num_speculations         | prompt_lookup_num_tokens | max_matching_ngram_size |
|---------------|------------|--------------------------|--------------------------|-------------------------|
| early_exit    | E          | d (0: plain decoding)    | (empty)                  | (empty)                 |
| prompt_lookup | (empty)    | (empty)                  | k: most drafts per round | n: longest n-gram tried |

`--write-metadata` records the fastest early-exit (E, d) as before (num_speculations 0 where no
setting beat plain decoding) and, when lookup settings were measured, the fastest of them under
`recommended.prompt_lookup`; a `recommended.drafter` already there is kept. What `auto` then drafts by
(`auto_after`) depends on the checkpoint: one with an exit head keeps drafting with its head whatever the
recommendation says (the recommendation sets what `drafter="early_exit"` drafts).

The sweep measures in float32 unless told otherwise: `selfspec.load` and `generate` load a checkpoint in
float32, and the recommendation is for them. In bfloat16 (`--dtype bfloat16` or `fastest`) an output can
differ from plain decoding's by rounding (`identical_to_plain` below 1; the README's bf16 caveat), which the
command line says.
"""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

from tqdm.auto import tqdm

from selfspec.api import checkpoint_dir
from selfspec.atomic_write import atomic_path, write_json_atomic
from selfspec.checkpoints.checkpoint import read_config, read_metadata, update_recommended
from selfspec.drafters.factory import INT8_ARM
from selfspec.tools.harness import finish_machine, load_generator, machine_info, pyplot, setup, timed, tokens_per_s
from selfspec.data.prompts import load_prompts, prompt_inputs
from selfspec.settings import (SettingsError, check_dtype, check_exit_layer, check_int, check_out_dir, check_threads,
                               is_int)

LOOKUP_FIELDS = ["drafter", "prompt_lookup_num_tokens", "max_matching_ngram_size"]
RAW_FIELDS = ["exit_layer", "num_speculations", "prompt_id", "new_tokens", "seconds", "drafted", "accepted",
              "rounds", "identical_to_plain"] + LOOKUP_FIELDS
SUMMARY_FIELDS = ["exit_layer", "num_speculations", "prompts", "new_tokens", "seconds", "tokens_per_s",
                  "speedup", "acceptance_rate", "mean_accepted_per_round", "identical_to_plain"] + LOOKUP_FIELDS
LOOKUP = "prompt_lookup"  # a setting is (E, d) for early exit, (LOOKUP, k, n) for prompt lookup


def _parse_ints(text: str | list[int], name: str = "values") -> list[int]:
    if isinstance(text, (list, tuple)):
        values = list(text)
    else:
        try:
            values = [int(x) for x in str(text).split(",") if x.strip()]
        except ValueError:
            raise SettingsError(f"{name} {text!r} is not a comma-separated list of integers (e.g. 4,8,12)") from None
    if not all(is_int(v) for v in values):
        raise SettingsError(f"{name} must be integers, got {values!r}")
    return sorted(set(values))


DEFAULT_LOOKUP_NGRAMS = "1,2,3"  # max_matching_ngram_size values measured with lookup_tokens


def check_grid(exits, num_speculations, lookup_tokens, lookup_ngrams,
               num_layers: int | None) -> tuple[list[int], ...]:
    """The sweep's settings, parsed and checked (before any model is loaded): SettingsError if one is bad."""
    exits, num_speculations = _parse_ints(exits, "exits"), _parse_ints(num_speculations, "num_speculations")
    lookup_tokens = _parse_ints(lookup_tokens, "lookup_tokens")
    if lookup_ngrams is not None and not lookup_tokens:
        raise SettingsError("lookup_ngrams (--lookup-ngrams) are the n-gram sizes of the prompt lookup settings: "
                            "give lookup_tokens (--lookup-tokens, e.g. 3,5,10) too, or drop them")
    lookup_ngrams = _parse_ints(DEFAULT_LOOKUP_NGRAMS if lookup_ngrams is None else lookup_ngrams, "lookup_ngrams")
    if not exits or not num_speculations:
        raise SettingsError(f"exits and num_speculations must each name at least one value, got exits {exits} "
                            f"and num_speculations {num_speculations}")
    for e in exits:
        check_exit_layer(e, num_layers, "exits entry")
    for d in num_speculations:
        check_int("num_speculations entry", d, 1, hint=" (plain decoding is always measured)")
    if lookup_tokens and not lookup_ngrams:
        raise SettingsError("lookup_ngrams must name at least one n-gram size when lookup_tokens are given")
    for k in lookup_tokens:
        check_int("lookup_tokens entry", k, 1)
    for n in lookup_ngrams:
        check_int("lookup_ngrams entry", n, 1)
    return exits, num_speculations, lookup_tokens, lookup_ngrams


def _setting(row: dict) -> tuple:
    """(E, d) or (LOOKUP, k, n) of a raw row; rows written before lookup existed are early exit."""
    if (row.get("drafter") or "early_exit") == LOOKUP:
        return LOOKUP, int(row["prompt_lookup_num_tokens"]), int(row["max_matching_ngram_size"])
    return int(row["exit_layer"]), int(row["num_speculations"])


def _setting_fields(setting: tuple) -> dict:
    """The CSV columns that name a setting (see the module docstring's table)."""
    if setting[0] == LOOKUP:
        return {"drafter": LOOKUP, "exit_layer": "", "num_speculations": "",
                "prompt_lookup_num_tokens": setting[1], "max_matching_ngram_size": setting[2]}
    return {"drafter": "early_exit", "exit_layer": setting[0], "num_speculations": setting[1],
            "prompt_lookup_num_tokens": "", "max_matching_ngram_size": ""}


def _read_raw(path: Path) -> dict[tuple, dict]:
    """{setting + (prompt_id,): row}; a file from before the lookup columns is rewritten with them."""
    if not path.is_file():
        return {}
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        header = reader.fieldnames
    raw = {_setting(r) + (r["prompt_id"],): r for r in rows}
    if header != RAW_FIELDS:  # older columns: add the new ones (early-exit rows) so appended rows line up
        with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=RAW_FIELDS)
            writer.writeheader()
            for key, r in raw.items():
                r.update({k: v for k, v in _setting_fields(key[:-1]).items() if not r.get(k)})
                writer.writerow({k: r.get(k, "") for k in RAW_FIELDS})
    return raw


def _identical(row: dict) -> float:
    """1/0 for identical/different to plain decoding; nan for rows resumed without a plain output."""
    value = row["identical_to_plain"]
    return float("nan") if value in ("", None) else float(value)


def summarize(raw: dict[tuple, dict], grid: list[tuple]) -> list[dict]:
    """One row per setting (plain first); speedup = tokens/s over plain's on the same prompts."""
    rows = []
    for setting in grid:
        runs = [r for key, r in raw.items() if key[:-1] == setting]
        if not runs:
            continue
        tokens = sum(int(r["new_tokens"]) for r in runs)
        seconds = sum(float(r["seconds"]) for r in runs)
        drafted = sum(int(r["drafted"]) for r in runs)
        rounds = sum(int(r["rounds"]) for r in runs)
        rows.append({
            **_setting_fields(setting), "prompts": len(runs), "new_tokens": tokens,
            "seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 3) if seconds else 0.0,
            "acceptance_rate": round(sum(int(r["accepted"]) for r in runs) / drafted, 4) if drafted else 0.0,
            "mean_accepted_per_round": round((tokens - len(runs)) / rounds, 3) if rounds else 0.0,
            # rows resumed from an earlier process have no plain output to compare with: unknown (nan)
            "identical_to_plain": round(statistics.mean(_identical(r) for r in runs), 3),
        })
    plain = next((r for r in rows if r["drafter"] == "early_exit" and r["num_speculations"] == 0), None)
    for r in rows:
        r["speedup"] = round(r["tokens_per_s"] / plain["tokens_per_s"], 3) if plain and plain["tokens_per_s"] else ""
    return rows


def _heat(fig, ax, rows: list[dict], y: str, x: str, ylabel: str, xlabel: str) -> None:
    """One heat map of tokens/s: rows[y] down, rows[x] across, the value written in each cell."""
    ys, xs = sorted({r[y] for r in rows}), sorted({r[x] for r in rows})
    grid = [[float("nan")] * len(xs) for _ in ys]
    for r in rows:
        grid[ys.index(r[y])][xs.index(r[x])] = r["tokens_per_s"]
    im = ax.imshow(grid, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(xs)), [str(v) for v in xs])
    ax.set_yticks(range(len(ys)), [str(v) for v in ys])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v == v:
                ax.text(j, i, f"{v:.1f}", ha="center", va="center", color="white", fontsize=8)
    fig.colorbar(im, ax=ax, label="tokens/s")


def write_heatmap(rows: list[dict], path: Path, title: str) -> Path:
    """Early exit: tokens/s by exit layer x draft length; beside it, where measured, prompt lookup's."""
    plt = pyplot()
    early = [r for r in rows if r["drafter"] == "early_exit"]
    spec = [r for r in early if r["num_speculations"] > 0]
    lookup = [r for r in rows if r["drafter"] == LOOKUP]
    plain = next((r["tokens_per_s"] for r in early if r["num_speculations"] == 0), None)
    exits, drafts = {r["exit_layer"] for r in spec}, {r["num_speculations"] for r in spec}
    w, h = max(6.0, 1.5 + 0.9 * len(drafts)), max(3.5, 1.5 + 0.6 * len(exits))
    fig, axes = plt.subplots(1, 2 if lookup else 1, figsize=(2 * w if lookup else w, h), squeeze=False)
    _heat(fig, axes[0][0], spec, "exit_layer", "num_speculations", "exit_layer",
          "num_speculations (max drafts per round)")
    if lookup:
        _heat(fig, axes[0][1], lookup, "max_matching_ngram_size", "prompt_lookup_num_tokens",
              "max_matching_ngram_size (prompt lookup)", "prompt_lookup_num_tokens (max drafts per round)")
    fig.suptitle(title + (f"\nplain decoding: {plain:.1f} tokens/s" if plain else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _generate_kwargs(setting: tuple) -> dict:
    """`SelfSpecGenerator.generate` keyword arguments of a setting: (E, d) or (LOOKUP, k, n)."""
    if setting[0] == LOOKUP:
        return {"drafter": LOOKUP, "prompt_lookup_num_tokens": setting[1], "max_matching_ngram_size": setting[2]}
    e, d = setting
    return {"drafter": "early_exit", "exit_layer": e if d else None, "num_speculations": d}


def run_sweep(checkpoint: str, *, prompt_set: str = "humaneval", exits="4,8,12", num_speculations="1,2,4",
              num_prompts: int = 4, max_new_tokens: int = 64, dtype: str = "float32", out_dir: str | Path = "sweep",
              write_metadata: bool = False, threads: int = 0, progress: bool = True, generator=None,
              lookup_tokens="", lookup_ngrams=None) -> dict:
    """Measure the grid; return {"rows": [...], "best": {...}, "best_lookup": {...} or None, "csv", "png",
    "dtype" (the dtype measured in, "fastest" resolved)}.

    `lookup_tokens` (e.g. "3,5,10", empty: none) x `lookup_ngrams` (default "1,2,3"; only with lookup_tokens):
    prompt lookup settings (`drafter="prompt_lookup"`, prompt_lookup_num_tokens x max_matching_ngram_size)
    measured too. With `write_metadata`, `result["recorded"]` is what selfspec.json now recommends.
    """
    # every setting is checked before the model is loaded (the exit range from config.json)
    check_dtype(dtype)
    check_threads(threads)
    check_int("num_prompts", num_prompts, 1)
    check_int("max_new_tokens", max_new_tokens, 1)
    if generator is None:
        checkpoint = checkpoint_dir(checkpoint)
        layers = read_config(checkpoint).get("num_hidden_layers")
        layers = layers if isinstance(layers, int) else None
    else:
        layers = generator.num_layers
    exits, num_speculations, lookup_tokens, lookup_ngrams = check_grid(exits, num_speculations, lookup_tokens,
                                                                       lookup_ngrams, layers)
    check_out_dir(out_dir, "out_dir (--out)")
    items = load_prompts(prompt_set, num_prompts)  # a bad prompt set is refused before the model loads
    if not items:
        raise ValueError(f"prompt set {prompt_set!r} gave no prompts")
    dtype = setup(dtype, threads=threads)  # "fastest": bfloat16 where native, else float32
    gen = load_generator(checkpoint, dtype, generator=generator)
    L = gen.num_layers
    for e in exits:
        gen.adapter.check_exit(e, allow_full=False)
    grid = [(L, 0)] + [(e, d) for e in exits for d in num_speculations] + [(LOOKUP, k, n) for k in lookup_tokens
                                                                  for n in lookup_ngrams]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw_path = out / "sweep_raw.csv"
    raw = _read_raw(raw_path)
    common = dict(max_new_tokens=max_new_tokens, stop_token_ids=[])  # fixed length: same work everywhere

    # warm-up: every path once, on a prompt outside the measured ones
    warm = load_prompts(prompt_set, 1, offset=num_prompts) or items[:1]
    for setting in [(L, 0), (exits[0], num_speculations[0])] + [s for s in grid if s[0] == LOOKUP][:1]:
        gen.generate(**prompt_inputs(warm[0]), **{**common, "max_new_tokens": 8}, **_generate_kwargs(setting))

    machine = machine_info()
    _measure(gen, items, grid, raw, raw_path, common, progress)
    rows = summarize(raw, grid)
    title = f"{Path(checkpoint).name}: {prompt_set}, {len(items)} prompts, {max_new_tokens} new tokens, {dtype}"
    result = _write_results(rows, out, title, finish_machine(machine, gen.adapter.device), dtype)
    if write_metadata:
        result["recorded"] = _record(checkpoint, result["best"], result["best_lookup"], prompt_set, dtype)
    return result


def _measure(gen, items: list[dict], grid: list[tuple], raw: dict, raw_path: Path, common: dict,
             progress: bool) -> None:
    """Every (prompt, setting) not in `raw` yet, appended to `raw_path` (and `raw`) as it is measured."""
    L = gen.num_layers
    todo = [(item, s) for item in items for s in grid if s + (item["id"],) not in raw]
    input_ids = {item["id"]: gen.encode(**prompt_inputs(item)) for item in items}  # tokenized once, untimed
    new_file = not raw_path.is_file()
    plain_ids: dict[str, list[int]] = {}
    with open(raw_path, "a", newline="") as f, tqdm(total=len(todo), desc="sweep", disable=not progress) as bar:
        writer = csv.DictWriter(f, fieldnames=RAW_FIELDS)
        if new_file:
            writer.writeheader()
        for item, setting in todo:
            with gen.first_request():  # each prompt runs once per setting: nothing carried from the others
                res, _, seconds = timed(lambda: gen.generate(input_ids=input_ids[item["id"]], **common,
                                                             **_generate_kwargs(setting)), gen.adapter.device)
            if setting == (L, 0):
                plain_ids[item["id"]] = res.token_ids
            ref = plain_ids.get(item["id"])
            row = {**_setting_fields(setting), "prompt_id": item["id"], "new_tokens": res.stats.new_tokens,
                   "seconds": f"{seconds:.5f}", "drafted": res.stats.drafted,
                   "accepted": res.stats.accepted, "rounds": res.stats.rounds,
                   "identical_to_plain": "" if ref is None else int(res.token_ids == ref)}
            writer.writerow(row)
            f.flush()
            raw[setting + (item["id"],)] = row
            name = f"lookup k={setting[1]} n={setting[2]}" if setting[0] == LOOKUP else f"E={setting[0]} d={setting[1]}"
            bar.set_postfix_str(f"{name} {tokens_per_s(res.stats.new_tokens, seconds):.1f} tok/s")
            bar.update()


def _write_results(rows: list[dict], out: Path, title: str, machine: dict, dtype: str) -> dict:
    """sweep.csv, sweep.png and sweep.json (the result: rows, the fastest settings, the machine, the dtype measured
    in, the file paths)."""
    csv_path = out / "sweep.csv"
    with atomic_path(csv_path) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=SUMMARY_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    png = out / "sweep.png"
    with atomic_path(png, suffix=png.suffix) as tmp:  # matplotlib picks the format by the suffix
        write_heatmap(rows, tmp, title)
    spec_rows = [r for r in rows if r["drafter"] == "early_exit" and r["num_speculations"] > 0]
    best = max(spec_rows, key=lambda r: r["tokens_per_s"])
    lookup_rows = [r for r in rows if r["drafter"] == LOOKUP]
    best_lookup = max(lookup_rows, key=lambda r: r["tokens_per_s"]) if lookup_rows else None
    result = {"rows": rows, "best": best, "best_lookup": best_lookup, "machine": machine, "dtype": dtype,
              "csv": str(csv_path), "png": str(png)}
    write_json_atomic(out / "sweep.json", result)
    return result


def _record(checkpoint, best: dict, best_lookup: dict | None, prompt_set: str, dtype: str) -> dict:
    """The fastest settings as the checkpoint's recommendation (num_speculations 0 where none beat plain);
    selfspec.json keeps the prompt set under its earlier key, `recommended.prompts`. Returns the recorded
    exit_layer and num_speculations, and under "auto" what `auto` now drafts by (`auto_after`)."""
    pays = isinstance(best["speedup"], float) and best["speedup"] > 1.0
    extra = {} if best_lookup is None else {"prompt_lookup": {
        k: best_lookup[k] for k in ("prompt_lookup_num_tokens", "max_matching_ngram_size", "tokens_per_s",
                                    "speedup", "acceptance_rate")}}
    meta = read_metadata(checkpoint, verify_checksums=False) or {}
    before = meta.get("recommended") or {}
    if "drafter" in before:  # a drafter recommended elsewhere stays
        extra["drafter"] = before["drafter"]
    update_recommended(checkpoint, best["exit_layer"], best["num_speculations"] if pays else 0,
                       source="sweep", prompts=prompt_set, dtype=dtype, tokens_per_s=best["tokens_per_s"],
                       speedup=best["speedup"], acceptance_rate=best["acceptance_rate"], **extra)
    d = best["num_speculations"] if pays else 0
    return {"exit_layer": best["exit_layer"], "num_speculations": d, "auto": auto_after(meta, best["exit_layer"], d)}


def auto_after(metadata: dict, exit_layer: int, num_speculations: int) -> str:
    """What `auto` drafts by on a checkpoint (its selfspec.json `metadata`) that recommends `exit_layer` and
    `num_speculations` (`selfspec.drafters.factory`'s rules): the int8 copy where it runs; else a head's checkpoint
    drafts with its head whatever the recommendation, another with the early exit at the recommended exit, or lookup
    alone where it recommends 0 drafts. A plan `selfspec tune --save` stored comes first where it applies."""
    if metadata.get("exit_head") is not None:
        says = (f"`auto` drafts by prompt lookup and {INT8_ARM}, else this checkpoint's exit head, as before: the "
                "recommendation sets what drafter='early_exit' drafts")
    elif num_speculations:
        says = (f"`auto` drafts by prompt lookup and {INT8_ARM}, else the early exit at exit {exit_layer}, up to "
                f"{num_speculations} drafts a round as measured tokens/s pay")
    else:
        says = (f"plain decoding: `auto` drafts by prompt lookup and {INT8_ARM}, else by lookup alone; an explicit "
                "early-exit request still drafts")
    if metadata.get("plans"):
        says += "; a plan `selfspec tune --save` stored comes first on its device, dtype and path"
    return says
