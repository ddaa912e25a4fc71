"""How far a reader walks to follow the Trainer's set-up: ``Trainer(cfg, env).setup()`` traced on a
world of one (the demo config on a tiny generated dataset), every call from one project file into
another recorded the first time the function is reached, in the order the set-up reaches it (a
reader reads each function once).

    python benchmarks/trainer_setup_walk.py [--config configs/demo.yaml] [--list]

Printed, over that walk:

- **files entered**: the project files whose code the set-up runs (``pinads_rec/``);
- **functions across files**: the functions reached by a call from another file (module bodies run
  by a lazy import left out: that is import order, not the set-up's logic);
- **climbs back up**: calls into a module that imports the caller's module (directly or through
  others, module-level and function-level imports alike): the reader, one layer down, is sent back
  to a layer above it;
- **returns to a file left**: calls into a file the walk had entered before and left (reading it
  again, not for the first time).

A call made through a library (TorchRec calling back into a project module) counts from the
nearest project frame on the stack. ``--list`` prints the walk itself, a line per call.
"""

from __future__ import annotations

import argparse
import ast
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Set, Tuple

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "pinads_rec"
# A few hundred generated requests: the set-up's walk does not depend on the data's size.
TINY = [
    "synth.train_requests=200",
    "synth.eval_requests=100",
    "synth.calibration_requests=100",
    "synth.num_files=1",
    "data.num_workers=0",
]


def module_name(path: Path) -> str:
    parts = path.resolve().relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> Dict[str, Set[str]]:
    """Each project module -> the project modules it imports (at any scope)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: Dict[str, Set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{parent}.{base}" if base else parent
                candidates = [f"{base}.{a.name}" for a in node.names]  # a name, or else its module
            else:
                continue
            for c in candidates:
                while c and c not in modules:
                    c = c.rpartition(".")[0]
                if c and c != name:
                    targets.add(c)  # the most specific module the name resolves to
        graph[name] = targets
    return graph


def reachable(graph: Dict[str, Set[str]], start: str) -> Set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def traced_setup(cfg) -> List[Tuple[str, str, str]]:
    """(caller file, callee file, callee function) of each function the set-up first reaches from
    another file."""
    from pinads_rec import parallel
    from pinads_rec.training.trainer import Trainer

    package = str(PACKAGE) + "/"
    seen: Set[object] = set()
    walk: List[Tuple[str, str, str]] = []

    def on_event(frame, event, arg):
        code = frame.f_code
        if event != "call" or code in seen or code.co_name == "<module>" or not code.co_filename.startswith(package):
            return
        caller = frame.f_back
        while caller is not None and not caller.f_code.co_filename.startswith(package):
            caller = caller.f_back
        if caller is None or caller.f_code.co_filename == code.co_filename:
            return
        seen.add(code)
        walk.append((caller.f_code.co_filename, code.co_filename, code.co_qualname))

    trainer = Trainer(cfg, parallel.init_distributed())
    sys.setprofile(on_event)
    try:
        trainer.setup()
    finally:
        sys.setprofile(None)
    return walk


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"))
    ap.add_argument("--list", action="store_true", help="print every call of the walk")
    args = ap.parse_args(argv)

    from pinads_rec import config
    from pinads_rec.data.synth import generate

    with tempfile.TemporaryDirectory(prefix="setup_walk_") as tmp:
        data = Path(tmp) / "data"
        overrides = TINY + [
            f"data.train_dir={data}/train",
            f"data.eval_dir={data}/eval",
            f"data.calibration_dir={data}/calibration",
            f"train.run_dir={tmp}/run",
        ]
        cfg = config.load(args.config, overrides)
        generate(cfg, data)
        walk = traced_setup(cfg)

    graph = import_graph()
    entered: List[str] = ["pinads_rec.training.trainer"]  # where the reader starts
    climbs = returns = 0
    for caller, callee, function in walk:
        a, b = module_name(Path(caller)), module_name(Path(callee))
        climb = a in reachable(graph, b)  # the callee's module depends on the caller's
        back = b in entered
        climbs += climb
        returns += back
        if b not in entered:
            entered.append(b)
        if args.list:
            marks = ("  climbs back up" if climb else "") + ("  returns" if back else "")
            print(f"{a} -> {b}.{function}{marks}")
    print(
        f"Trainer.setup: {len(entered)} files entered, {len(walk)} functions across files, "
        f"{climbs} climbs back up, {returns} returns to a file left"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
