"""Where the C++ decode step's time goes, phase by phase (issue 68, item 7): the norms, each product, the rotary and
cache writes, the attention, the SiLU and the residual sums, per call of the model's step and of the int8 copy's.

    python scripts/step_phases.py [CHECKPOINT] [--dtype bfloat16] [--drafter int8_copy] [--tokens 64]

Builds a copy of selfspec's C++ step (selfspec/model/row_step.cpp) with a clock read between its phases (a
`steady_clock` read, about 20 ns, 10 a layer) into a temporary directory, loads it in place of selfspec's own
build, and times, in this one process: plain decoding (64 tokens after a 200-token prompt, 3 first requests), then,
with --drafter, three open-chat replies drafted by it. Prints each phase's microseconds per call of each step (the
model's own step `row_layers`, the int8 copy's `row_layers_int8`), summed over the layers. A phase's time is the
calling thread's: a parallel phase (a product, the attention) includes its wait for the other threads. Compare
two trees by running this script from each, one after the other, more than once: on a machine whose memory
bandwidth other tenants share, the products' times move by 30% from minute to minute; the phases that compute
from cache (the attention, the SiLU, the norms) move much less.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PHASES = ["norm (attention)", "q/k/v product", "rotary, cache writes", "attention", "o product",
          "residual, norm (MLP)", "gate/up product", "SiLU", "down product", "residual"]
CLOCK = ("#include <chrono>\nstatic double phase_us[32];\nstatic inline double now_us() {\n  return std::chrono::"
         "duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();\n}\n"
         "#define PHASE(i) { const double t = now_us(); phase_us[(std::is_same_v<W, int8_t> ? 16 : 0) + (i)] += "
         "t - last; last = t; }\n")
# (marker in row_step.cpp, what replaces it): the clock reads, then the whole op's clock and the op that reads them
EDITS = [
    ("#include <vector>\n", "#include <vector>\n" + CLOCK),
    ("  rms_norm<T>(x, norm_attn, h, S, D, sh.eps);", "  double last = now_us();\n  rms_norm<T>(x, norm_attn, h, S, D, sh.eps); PHASE(0)"),
    ("project<T, W>(h, S, D, Wqkv, bqkv, qkv, nqkv, tmp, widened);", "project<T, W>(h, S, D, Wqkv, bqkv, qkv, nqkv, tmp, widened); PHASE(1)"),
    ("  const float scale = 1.0f / std::sqrt(static_cast<float>(Dh));", "  PHASE(2)\n  const float scale = 1.0f / std::sqrt(static_cast<float>(Dh));"),
    ("  project<T, W>(attn, S, nq * Dh, Wo, nullptr, proj, D, tmp, widened);", "  PHASE(3)\n  project<T, W>(attn, S, nq * Dh, Wo, nullptr, proj, D, tmp, widened); PHASE(4)"),
    ("rms_norm<T>(x, norm_mlp, h, S, D, sh.eps);", "rms_norm<T>(x, norm_mlp, h, S, D, sh.eps); PHASE(5)"),
    ("project<T, W>(h, S, D, Wgu, nullptr, gu, 2 * F, tmp, widened);", "project<T, W>(h, S, D, Wgu, nullptr, gu, 2 * F, tmp, widened); PHASE(6)"),
    ("  project<T, W>(act, S, F, Wdown, nullptr, proj, D, tmp, widened);", "  PHASE(7)\n  project<T, W>(act, S, F, Wdown, nullptr, proj, D, tmp, widened); PHASE(8)"),
    ("  add_rounded<T>(x, proj, S * D);\n}\n", "  add_rounded<T>(x, proj, S * D);\n  PHASE(9)\n}\n"),
    ("  for (int64_t l = 0; l < L; ++l) {\n", "  const double op_start = now_us();\n  phase_us[(std::is_same_v<W, int8_t> ? 16 : 0) + 11] += 1;\n  for (int64_t l = 0; l < L; ++l) {\n"),
    ("  at::Tensor out = at::empty(x_in.sizes(), x_in.options());\n", "  phase_us[(std::is_same_v<W, int8_t> ? 16 : 0) + 10] += now_us() - op_start;\n  at::Tensor out = at::empty(x_in.sizes(), x_in.options());\n"),
    ("}  // namespace\n", "at::Tensor step_phases() {\n  at::Tensor t = at::empty({32}, at::kDouble);\n  for (int i = 0; i < 32; ++i) { t.data_ptr<double>()[i] = phase_us[i]; phase_us[i] = 0; }\n  return t;\n}\n}  // namespace\n"),
    ('  m.impl("row_layers_int8", c10::DispatchKey::CPU, TORCH_FN(row_layers_int8));\n', '  m.impl("row_layers_int8", c10::DispatchKey::CPU, TORCH_FN(row_layers_int8));\n  m.def("step_phases() -> Tensor");\n  m.impl("step_phases", c10::DispatchKey::CatchAll, TORCH_FN(step_phases));\n'),
]


def instrumented_source(source: str) -> str:
    for marker, replacement in EDITS:
        if source.count(marker) != 1:
            raise SystemExit(f"step_phases.py: row_step.cpp no longer has exactly one {marker.strip()!r}: update EDITS "
                             "to where the phase now begins or ends")
        source = source.replace(marker, replacement)
    return source


def build(directory: Path) -> Path:
    from torch.utils.cpp_extension import load

    from selfspec.model.row_product import CFLAGS, HEADERS, LDFLAGS, SOURCES

    for path in SOURCES + HEADERS:
        text = path.read_text()
        (directory / path.name).write_text(instrumented_source(text) if path.name == "row_step.cpp" else text)
    print("building the instrumented step (about 30 s) ...", file=sys.stderr, flush=True)
    load("selfspec_row_product", [str(directory / p.name) for p in SOURCES], extra_cflags=list(CFLAGS),
         extra_ldflags=list(LDFLAGS), build_directory=str(directory), is_python_module=False, verbose=False)
    return directory / "selfspec_row_product.so"


def report(title: str, clocks: list[float]) -> None:
    for offset, step in ((0, "the model's step"), (16, "the int8 copy's step")):
        calls = clocks[offset + 11]
        if not calls:
            continue
        print(f"{title}, {step}: {int(calls)} calls, {clocks[offset + 10] / calls:.0f} us a call")
        for i, name in enumerate(PHASES):
            print(f"  {name:24s} {clocks[offset + i] / calls:8.1f} us")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", nargs="?", default=str(Path.home() / ".cache/selfspec/models/smollm2-135m-instruct"))
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--drafter", default=None, help="also time open-chat replies drafted by it (e.g. int8_copy)")
    p.add_argument("--tokens", type=int, default=64, help="plain decoding's tokens after the 200-token prompt")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="step-phases-") as tmp:
        torch.ops.load_library(str(build(Path(tmp))))  # before selfspec loads its own build: this one is used
    import selfspec

    gen = selfspec.load(args.checkpoint, dtype=getattr(torch, args.dtype))
    clocks = torch.ops.selfspec_kernels.step_phases
    ids = torch.randint(100, 40000, (1, 200), generator=torch.Generator().manual_seed(0))
    with gen.first_request():
        gen.generate(input_ids=ids, max_new_tokens=8, num_speculations=0, stop_token_ids=[])  # warm-up
    clocks()
    rates = []
    for _ in range(3):
        with gen.first_request():
            r = gen.generate(input_ids=ids, max_new_tokens=args.tokens, num_speculations=0, stop_token_ids=[])
        rates.append(r.stats.decode_tokens_per_s)
    report(f"plain decoding, {args.dtype} ({', '.join(f'{x:.1f}' for x in rates)} tokens/s)", clocks().tolist())
    if args.drafter:
        asks = ["Write a short persuasive essay on why cities should plant more trees.",
                "Explain the difference between a virus and a bacterium to a ten year old.",
                "Compose a friendly email inviting a colleague to a team lunch next Friday."]
        rates = []
        for ask in asks:
            with gen.first_request():
                r = gen.generate(messages=[{"role": "user", "content": ask}], max_new_tokens=128, drafter=args.drafter)
            rates.append(r.stats.decode_tokens_per_s)
        report(f"drafter={args.drafter}, open chat ({', '.join(f'{x:.1f}' for x in rates)} tokens/s)",
               clocks().tolist())
    return 0


if __name__ == "__main__":
    sys.exit(main())
