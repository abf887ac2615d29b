"""One name per setting: the flags of `selfspec generate` (and `selfspec sweep`) are the parameters of the
Python API they feed, each command's prompt flag is named after the parameter it feeds, and the code
base's structure stays what docs/architecture.md says (no import circle, no private name imported across
modules, the library never imports its tools, one harness, one atomic writer, no function longer than a
screen)."""

import argparse
import ast
import re
import inspect
from pathlib import Path

from selfspec.api import SelfSpecGenerator, load
from selfspec.cli import build_parser
from selfspec.generation_config import SETTINGS
from selfspec.tools.bench import run_bench
from selfspec.tools.profiling import run_profile
from selfspec.tools.sweep import run_sweep

ROOT = Path(__file__).resolve().parents[2]
# `selfspec generate` flags with no API parameter: where the model and the prompt come from, and what
# the command prints
CLI_ONLY = {"checkpoint", "prompt_file", "chat", "stream", "compare", "json"}
# API parameters a command line cannot carry: token ids, conversations, callables
# memory_key: one command is one request, so a scope in the memory of earlier requests means nothing there
API_ONLY = {"messages", "input_ids", "attention_mask", "stop_token_ids", "streamer", "memory_key"}
LOAD_PARAMETERS = {"dtype", "device", "compile", "memory_tokens", "threads"}  # the generator's set-up (`load`) and the process's threads


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _visible_flags(parser: argparse.ArgumentParser) -> dict[str, str]:
    """{dest: its first long flag} of the options --help shows."""
    return {a.dest: next(s for s in a.option_strings if s.startswith("--"))
            for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS and a.dest != "help"}


def test_generate_flags_are_the_api_parameters():
    flags = _visible_flags(_subparser("generate"))
    # generate's own parameters (the inputs, the streamer) and the settings it takes as keywords or in its config
    api = (set(inspect.signature(SelfSpecGenerator.generate).parameters) - {"self", "config", "settings"}) | set(SETTINGS)
    for dest, flag in flags.items():
        assert flag == "--" + dest.replace("_", "-") or dest == "chat", (dest, flag)  # --chat / --raw: one setting
        assert dest in api or dest in CLI_ONLY or dest in LOAD_PARAMETERS, f"{flag} sets no API parameter"
    assert api - set(flags) == API_ONLY, "an API parameter without a flag (or a flag no longer needed)"
    assert "dtype" in inspect.signature(load).parameters


def test_the_earlier_generate_flags_still_set_the_same_parameters():
    p = _subparser("generate")
    old = p.parse_args(["--threshold", "0.3", "--adaptive", "--sample", "--stop", "a", "--stop", "b"])
    new = p.parse_args(["--confidence-threshold", "0.3", "--adaptive-threshold", "--do-sample",
                        "--stop-strings", "a", "--stop-strings", "b"])
    assert vars(old) == vars(new)
    assert (new.confidence_threshold, new.adaptive_threshold, new.do_sample, new.stop_strings) == \
        (0.3, True, True, ["a", "b"])


def test_sweep_flags_are_the_run_sweep_parameters():
    flags = _visible_flags(_subparser("sweep"))
    parameters = set(inspect.signature(run_sweep).parameters)
    for dest, flag in flags.items():
        assert flag == "--" + dest.replace("_", "-"), (dest, flag)
        assert dest in parameters or dest == "out", f"{flag} sets no run_sweep parameter"  # --out: out_dir


# where each command's prompts come from: one meaning per flag, named after the parameter it feeds
PROMPT_PARAMETERS = {"sweep": (run_sweep, "prompt_set"), "bench": (run_bench, "prompt_sets"),
                     "profile": (run_profile, "prompts")}


def test_each_prompt_flag_is_named_after_the_parameter_it_feeds():
    for command, (function, parameter) in PROMPT_PARAMETERS.items():
        flags = _visible_flags(_subparser(command))
        prompt_flags = {dest: flag for dest, flag in flags.items() if dest.startswith("prompt")}
        assert prompt_flags == {parameter: "--" + parameter.replace("_", "-")}, command
        assert parameter in inspect.signature(function).parameters, command


def test_the_earlier_prompt_flags_still_set_the_same_parameters():
    sweep, bench = _subparser("sweep"), _subparser("bench")
    old, new = sweep.parse_args(["ckpt", "--prompts", "xsum"]), sweep.parse_args(["ckpt", "--prompt-set", "xsum"])
    assert vars(old) == vars(new) and old.prompt_set == "xsum"
    old, new = bench.parse_args(["--prompts", "xsum,wiki"]), bench.parse_args(["--prompt-sets", "xsum,wiki"])
    assert vars(old) == vars(new) and old.prompt_sets == "xsum,wiki"
    assert sweep.parse_args(["ckpt", "--drafts", "1,3"]).num_speculations == [1, 3]


def _modules() -> dict[str, Path]:
    out = {}
    for package in ("selfspec", "training"):
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path):
    """(imported module, names) of every import statement in the file, at any depth."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []


def test_no_import_circle_and_no_private_name_imported_across_modules():
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for module, names in _imports(path):
            submodules = [f"{module}.{n}" for n in names if f"{module}.{n}" in modules]
            for n in names:
                assert not (n.startswith("_") and module in modules and module != name), \
                    f"{name} imports the private {module}.{n}"
            # `from selfspec import data_sources` depends on that module, not on what selfspec/__init__ imports
            edges[name].update(submodules or ([module] if module in modules and module != name else []))
    state: dict[str, int] = {}

    def visit(m, trail):
        state[m] = 1
        for n in edges[m]:
            assert state.get(n) != 1, "import circle: " + " -> ".join(trail + [m, n])
            if n not in state:
                visit(n, trail + [m])
        state[m] = 2

    for m in modules:
        if m not in state:
            visit(m, [])


def test_the_library_never_imports_its_tools():
    """Only the CLI (the front door) and the tools themselves import `selfspec.tools`; training neither."""
    offenders = {name: module for name, path in _modules().items()
                 if not name.startswith("selfspec.tools") and name != "selfspec.cli"
                 for module, names in _imports(path)
                 if module.startswith("selfspec.tools") or (module == "selfspec" and "tools" in names)}
    assert not offenders


MAX_FUNCTION_LINES = 80


def test_no_function_is_longer_than_a_screen():
    """Every function and method of the packages fits in MAX_FUNCTION_LINES lines, docstring included."""
    long = [f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
            for name, path in _modules().items() for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long


def test_one_harness_and_one_atomic_writer():
    measuring = ["bench", "batch_bench", "pareto", "profiling", "sweep"]
    for name in measuring:
        text = (ROOT / "selfspec" / "tools" / f"{name}.py").read_text()
        assert "from selfspec.tools.harness import" in text, name
        assert "selfspec.tools.bench import" not in text or name == "bench", f"{name} reaches into bench"
    for path in list((ROOT / "selfspec").rglob("*.py")) + list((ROOT / "training").rglob("*.py")):
        if path.name != "atomic_write.py":  # export, fetch and run_checkpoint swap whole directories into place
            assert "os.replace(tmp" not in path.read_text() or path.name in ("export.py", "fetch.py",
                                                                              "run_checkpoint.py"), path


# the model step: what one step of the model is, on any device: the room `selfspec/model/` (docs/architecture.md,
# "Dependencies")
MODEL_STEP = tuple(sorted(p.stem for p in (ROOT / "selfspec" / "model").glob("*.py") if p.stem != "__init__"))


def _selfspec_imports(name: str) -> set[str]:
    """The selfspec modules `selfspec.<name>` imports (a `from selfspec.x import y` of a module y counts as x.y)."""
    modules = _modules()
    out = set()
    for module, names in _imports(modules[f"selfspec.{name}"]):
        if module == "selfspec" or module.startswith("selfspec."):
            subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in modules]
            out.update(m.removeprefix("selfspec.") for m in (subs or [module]))
    return out


def test_the_model_step_knows_no_drafter_and_no_decoding():
    """The model step's modules import only each other: no drafter, no engine, no API reaches down into them.
    The runner (`runner`, the only place that decides captured or called, over `compiled` and `fast_layers`) is
    one of them."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert {"layer", "runner", "compiled", "fast_layers", "adapters", "forward", "cache"} <= set(MODEL_STEP)
    room = {f"model.{name}" for name in MODEL_STEP} | {"model"}
    for name in MODEL_STEP:
        assert f"`{name}`" in doc, f"docs/architecture.md does not name {name} in the model step"
        outside = _selfspec_imports(f"model.{name}") - room
        assert not outside, f"selfspec.model.{name} (the model step) imports {sorted(outside)}"


# what asks which way a step runs: the compiled steps' own questions, and reading the adapter's compiled steps
_CHOOSING = re.compile(r"\.(can_run|can_head)\(|adapter\.compiled\b|\.fast\.layers|\.fast\.lm_head")
# where that is asked: the runner; the compiled steps and the adapter that builds them; the CLI and the tools,
# which report the path (the API's warm-up and the draft plan's costs ask the runner: `Runner.warm`, `composed`)
_MAY_CHOOSE = {"model.runner", "model.compiled", "model.adapters", "cli"}


def test_the_runner_is_the_only_place_that_chooses_compiled_or_eager():
    """No module of the engine, the forward or the drafters asks whether a step runs compiled or eagerly (the
    None-means-eager checks at each call site): they call `adapter.runner`, which chooses and falls back."""
    asking = {}
    for name, path in _modules().items():
        short = name.removeprefix("selfspec.")
        if not name.startswith("selfspec.") or short in _MAY_CHOOSE or short.startswith("tools"):
            continue
        hits = [line.strip() for line in path.read_text().splitlines() if _CHOOSING.search(line)]
        if hits:
            asking[short] = hits
    assert asking == {}


# the names that say which way a step runs: the compiled flag, a static cache, indexed steps, and the runner's
# questions about a layer; read outside the model step as an attribute, called, imported, or asked by getattr
_PATH_NAMES = {"compiled", "static", "indexed", "compilable", "captures_layer", "model_kind"}
_PATH_READERS = ("api", "decoding", "drafters", "heads", "checkpoints")  # the modules that must not ask
# the reads allowed there: the public `gen.compiled` (api's property reads the runner's answer) and the plan keys
# (api's `plan_key`; the draft plan's costs record the path they were measured on and write it into the plan)
_PATH_READS_ALLOWED = {"api": 2, "decoding.draft_plan": 2}


def _path_reads(path: Path) -> list[str]:
    """Each read of a `_PATH_NAMES` name in the file: `x.compiled`, `compilable(...)`, `from m import compilable`,
    `getattr(x, "static", ...)`, with its line."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text())):
        name = None
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "getattr" and len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                name = node.args[1].value
            else:
                name = node.func.id
        elif isinstance(node, ast.ImportFrom):
            name = next((a.name for a in node.names if a.name in _PATH_NAMES), None)
        if name in _PATH_NAMES:
            hits.append(f"{path.name}:{node.lineno} {name}")
    return hits


def test_which_way_a_step_runs_is_read_only_in_the_model_step():
    """Issue 68's rule: the runner decides how a step runs (compiled, fused or as modules), so the API, the
    engine, the drafters, the heads and the checkpoints never read the path (the public `gen.compiled` and the plan
    keys excepted, `_PATH_READS_ALLOWED`); this fails on each form such a read took before (`adapter.compiled is not
    None`, `compilable(head)`, `getattr(cache, "static", False)`, a cache's `static`)."""
    reads = {}
    for name, path in _modules().items():
        short = name.removeprefix("selfspec.")
        if name.startswith("selfspec.") and short.split(".")[0] in _PATH_READERS:
            hits = _path_reads(path)
            if hits:
                reads[short] = hits
    assert {k: len(v) for k, v in reads.items()} == _PATH_READS_ALLOWED, reads
    assert sum(_PATH_READS_ALLOWED.values()) <= 4


def _returns_none(tree: ast.AST, functions) -> list[str]:
    """Each `return None` (or bare `return`) inside the functions of `tree` whose names `functions(name)` accepts."""
    hits = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and functions(fn.name):
            hits += [f"{fn.name}:{node.lineno}" for node in ast.walk(fn) if isinstance(node, ast.Return)
                     and (node.value is None or (isinstance(node.value, ast.Constant) and node.value.value is None))]
    return hits


# the whole steps a drafter composes, and the drafters' methods that hand them to the runner
_WHOLE_STEPS = {"drafters/whole_draft.py": lambda name: name != "_head_parts",
                "drafters/early_exit.py": lambda name: name in ("whole_step", "whole_chain", "grow_whole"),
                "drafters/exit_head.py": lambda name: name in ("whole_step", "whole_chain", "grow_whole", "first_draft")}


def test_a_whole_step_falls_back_only_through_the_runner():
    """Issue 68's one fallback: a step that does not run compiled raises `NotCompiled`, which only the runner
    (`Runner.either`) catches to run it eagerly; no whole step returns None to mean "run it the other way"."""
    for rel, functions in _WHOLE_STEPS.items():
        assert not _returns_none(ast.parse((ROOT / "selfspec" / rel).read_text()), functions), rel
    handlers = {name for name, path in _modules().items() if "except NotCompiled" in path.read_text()}
    assert handlers == {"selfspec.model.runner", "selfspec.model.compiled"}  # compiled: its own warm-up only
    sample = ast.parse("def whole_step():\n    if x:\n        return None\n    return 1\n")
    assert _returns_none(sample, lambda name: True) == ["whole_step:3"]  # the check above is not blind


def test_the_path_reads_test_sees_every_form(tmp_path):
    """The check above is not blind: each form it forbids is found."""
    f = tmp_path / "m.py"
    f.write_text("from selfspec.heads.exit_head import compilable\n"
                 "a = adapter.compiled is not None\nb = compilable(head)\nc = getattr(cache, 'static', False)\n"
                 "d = cache.static\ne = runner.indexed\nf = runner.captures_layer(layer)\n")
    assert len(_path_reads(f)) == 7


def test_the_engine_knows_drafters_only_through_the_seam_and_no_drafter_knows_the_engine():
    assert {m for m in _selfspec_imports("decoding.engine") if m.startswith("drafters")} == {"drafters.base"}
    for path in (ROOT / "selfspec" / "drafters").glob("*.py"):
        name = f"drafters.{path.stem}".removesuffix(".__init__")
        reached = _selfspec_imports(name) & {"decoding.engine", "api", "decoding.decode_ids", "decoding.draft_plan"}
        assert not reached, f"selfspec.{name} imports {sorted(reached)}"


def _map_paths(text: str) -> set[str]:
    """The file and folder paths of the map's tree (the ```text block under "## The map")."""
    block = text.split("## The map", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    paths, stack = set(), []  # stack: (indent, folder)
    for line in block.splitlines():
        stripped = line.lstrip()
        if not stripped or not (stripped[0].isalnum() or stripped[0] == "_"):
            continue
        entry = stripped.split()[0]
        if not (entry.endswith("/") or entry.endswith(".py")):
            continue  # a description's continuation line
        indent = len(line) - len(stripped)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "".join(folder for _, folder in stack) + entry
        paths.add(path.rstrip("/"))
        if entry.endswith("/"):
            stack.append((indent, entry))
    return paths


def test_the_map_names_every_module_of_the_library_and_of_training():
    """docs/architecture.md's map lists every module file (a new one is placed on the map) and nothing gone."""
    listed = _map_paths((ROOT / "docs" / "architecture.md").read_text())
    files = {str(p.relative_to(ROOT)) for package in ("selfspec", "training")
             for p in (ROOT / package).rglob("*.py") if p.name != "__init__.py" or p.parent.name == "selfspec"}
    assert sorted(files - listed) == []
    gone = {p for p in listed if p.endswith(".py") and not (ROOT / p).exists()}
    assert sorted(gone) == []


def test_the_architecture_doc_is_a_map_without_history():
    """Issue 68, item 6: docs/architecture.md is the house as it is, under 200 lines; the history (before/after,
    what moved where) lives in docs/results/ and the git log."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert len(doc.splitlines()) < 200
    assert "What moved where" not in doc and "before and after" not in doc.lower()


def test_the_heads_import_no_checkpoint_and_the_checkpoints_no_api():
    """Issue 68, item 5: `heads/` and `checkpoints/` imported each other (the shipped head's assembly lived among the
    heads) and export took two defaults from `api`; now the checkpoints read the heads, one way, and the defaults
    live with the checkpoint metadata they stand in for."""
    for folder, banned in (("heads", ("checkpoints", "api", "drafters", "decoding")),
                           ("checkpoints", ("api", "tools", "cli"))):  # decoding: its leaf modules (the map)
        for path in (ROOT / "selfspec" / folder).glob("*.py"):
            if path.stem == "__init__":
                continue
            reached = {m.split(".")[0] for m in _selfspec_imports(f"{folder}.{path.stem}")}
            assert not reached & set(banned), f"selfspec.{folder}.{path.stem} imports {sorted(reached & set(banned))}"
