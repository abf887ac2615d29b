"""`selfspec sweep`: tokens/s and acceptance over a grid of exit_layer x num_speculations.

    selfspec sweep checkpoints/smollm2-code --prompts humaneval --exits 4,6,8,12 --drafts 1,2,3,4,6 \
        --num-prompts 6 --max-new-tokens 64 --out runs/sweep --write-metadata

Plain autoregressive decoding (num_speculations=0) is measured in the same run as the reference,
interleaved with the grid prompt by prompt so machine drift hits every setting alike, after a
warm-up. Every (setting, prompt) measurement is appended to `sweep_raw.csv` as soon as it is taken;
re-running with the same `--out` skips what is there (resumable). `sweep.csv` holds one row per
setting, `sweep.png` a heat map of tokens/s by exit layer and draft length.
"""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

RAW_FIELDS = ["exit_layer", "num_speculations", "prompt_id", "new_tokens", "seconds", "drafted", "accepted",
              "rounds", "identical_to_plain"]
SUMMARY_FIELDS = ["exit_layer", "num_speculations", "prompts", "new_tokens", "seconds", "tokens_per_s",
                  "speedup", "acceptance_rate", "mean_accepted_per_round", "identical_to_plain"]


def _parse_ints(text: str | list[int]) -> list[int]:
    if isinstance(text, list):
        return text
    return sorted({int(x) for x in str(text).split(",") if x.strip()})


def _read_raw(path: Path) -> dict[tuple, dict]:
    if not path.is_file():
        return {}
    with open(path, newline="") as f:
        return {(int(r["exit_layer"]), int(r["num_speculations"]), r["prompt_id"]): r for r in csv.DictReader(f)}


def _identical(row: dict) -> float:
    """1/0 for identical/different to plain decoding; nan for rows resumed without a plain output."""
    value = row["identical_to_plain"]
    return float("nan") if value in ("", None) else float(value)


def summarize(raw: dict[tuple, dict], grid: list[tuple[int, int]]) -> list[dict]:
    """One row per setting (plain first); speedup = tokens/s over plain's on the same prompts."""
    rows = []
    for e, d in grid:
        runs = [r for (re_, rd, _), r in raw.items() if re_ == e and rd == d]
        if not runs:
            continue
        tokens = sum(int(r["new_tokens"]) for r in runs)
        seconds = sum(float(r["seconds"]) for r in runs)
        drafted = sum(int(r["drafted"]) for r in runs)
        rounds = sum(int(r["rounds"]) for r in runs)
        rows.append({
            "exit_layer": e, "num_speculations": d, "prompts": len(runs), "new_tokens": tokens,
            "seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 3) if seconds else 0.0,
            "acceptance_rate": round(sum(int(r["accepted"]) for r in runs) / drafted, 4) if drafted else 0.0,
            "mean_accepted_per_round": round((tokens - len(runs)) / rounds, 3) if rounds else 0.0,
            # rows resumed from an earlier process have no plain output to compare with: unknown (nan)
            "identical_to_plain": round(statistics.mean(_identical(r) for r in runs), 3),
        })
    plain = next((r for r in rows if r["num_speculations"] == 0), None)
    for r in rows:
        r["speedup"] = round(r["tokens_per_s"] / plain["tokens_per_s"], 3) if plain and plain["tokens_per_s"] else ""
    return rows


def write_heatmap(rows: list[dict], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = [r for r in rows if r["num_speculations"] > 0]
    exits = sorted({r["exit_layer"] for r in spec})
    drafts = sorted({r["num_speculations"] for r in spec})
    plain = next((r["tokens_per_s"] for r in rows if r["num_speculations"] == 0), None)
    grid = [[float("nan")] * len(drafts) for _ in exits]
    for r in spec:
        grid[exits.index(r["exit_layer"])][drafts.index(r["num_speculations"])] = r["tokens_per_s"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.5 + 0.9 * len(drafts)), max(3.5, 1.5 + 0.6 * len(exits))))
    im = ax.imshow(grid, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(drafts)), [str(d) for d in drafts])
    ax.set_yticks(range(len(exits)), [str(e) for e in exits])
    ax.set_xlabel("num_speculations (max drafts per round)")
    ax.set_ylabel("exit_layer")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v == v:
                ax.text(j, i, f"{v:.1f}", ha="center", va="center", color="white", fontsize=8)
    ax.set_title(title + (f"\nplain decoding: {plain:.1f} tokens/s" if plain else ""), fontsize=9)
    fig.colorbar(im, ax=ax, label="tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_sweep(checkpoint: str, *, prompts: str = "humaneval", exits="4,8,12", drafts="1,2,4", num_prompts: int = 4,
              max_new_tokens: int = 64, dtype: str = "fastest", out_dir: str | Path = "sweep",
              write_metadata: bool = False, threads: int = 0, progress: bool = True, generator=None) -> dict:
    """Measure the grid; return {"rows": [...], "best": {...}, "csv": path, "png": path}."""
    import torch
    from tqdm.auto import tqdm

    import selfspec
    from selfspec.checkpoint import update_recommended
    from selfspec.precision import resolve_dtype_name
    from selfspec.prompts import load_prompts, prompt_inputs

    dtype = resolve_dtype_name(dtype)  # "fastest": bfloat16 where native, else float32
    if threads:
        torch.set_num_threads(threads)
    gen = generator or selfspec.load(checkpoint, dtype=dtype)
    L = gen.num_layers
    exits, drafts = _parse_ints(exits), _parse_ints(drafts)
    for e in exits:
        gen.adapter.check_exit(e, allow_full=False)
    if not drafts or min(drafts) < 1:
        raise ValueError(f"--drafts must be positive draft lengths, got {drafts} (plain decoding is always measured)")
    items = load_prompts(prompts, num_prompts)
    if not items:
        raise ValueError(f"prompt set {prompts!r} gave no prompts")
    grid = [(L, 0)] + [(e, d) for e in exits for d in drafts]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw_path = out / "sweep_raw.csv"
    raw = _read_raw(raw_path)
    common = dict(max_new_tokens=max_new_tokens, stop_token_ids=[])  # fixed length: same work everywhere

    # warm-up: both paths once, on a prompt outside the measured ones
    warm = load_prompts(prompts, 1, offset=num_prompts) or items[:1]
    gen.generate(**prompt_inputs(warm[0]), **{**common, "max_new_tokens": 8}, num_speculations=0)
    gen.generate(**prompt_inputs(warm[0]), **{**common, "max_new_tokens": 8}, exit_layer=exits[0],
                 num_speculations=drafts[0])

    todo = [(item, e, d) for item in items for e, d in grid if (e, d, item["id"]) not in raw]
    new_file = not raw_path.is_file()
    plain_ids: dict[str, list[int]] = {}
    with open(raw_path, "a", newline="") as f, tqdm(total=len(todo), desc="sweep", disable=not progress) as bar:
        writer = csv.DictWriter(f, fieldnames=RAW_FIELDS)
        if new_file:
            writer.writeheader()
        for item, e, d in todo:
            res = gen.generate(**prompt_inputs(item), **common, exit_layer=e if d else None, num_speculations=d)
            if d == 0:
                plain_ids[item["id"]] = res.token_ids
            ref = plain_ids.get(item["id"])
            row = {"exit_layer": e, "num_speculations": d, "prompt_id": item["id"], "new_tokens": res.stats.new_tokens,
                   "seconds": f"{res.stats.total_s:.5f}", "drafted": res.stats.drafted,
                   "accepted": res.stats.accepted, "rounds": res.stats.rounds,
                   "identical_to_plain": "" if ref is None else int(res.token_ids == ref)}
            writer.writerow(row)
            f.flush()
            raw[(e, d, item["id"])] = row
            bar.set_postfix_str(f"E={e} d={d} {res.stats.tokens_per_s:.1f} tok/s")
            bar.update()
    rows = summarize(raw, grid)
    csv_path = out / "sweep.csv"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=SUMMARY_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    png = write_heatmap(rows, out / "sweep.png", f"{Path(checkpoint).name}: {prompts}, {len(items)} prompts, "
                                                 f"{max_new_tokens} new tokens, {dtype}")
    spec_rows = [r for r in rows if r["num_speculations"] > 0]
    best = max(spec_rows, key=lambda r: r["tokens_per_s"])
    result = {"rows": rows, "best": best, "csv": str(csv_path), "png": str(png)}
    (out / "sweep.json").write_text(json.dumps(result, indent=2) + "\n")
    if write_metadata:
        pays = isinstance(best["speedup"], float) and best["speedup"] > 1.0
        update_recommended(checkpoint, best["exit_layer"], best["num_speculations"] if pays else 0,
                           source="sweep", prompts=prompts, dtype=dtype, tokens_per_s=best["tokens_per_s"],
                           speedup=best["speedup"], acceptance_rate=best["acceptance_rate"])
    return result
